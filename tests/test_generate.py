"""Stage ``generate`` with the ``local`` backend: answers, token counts, reproducibility, skips, resume."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from eagle3.backends.base import Request, split_reasoning
from eagle3.backends.local import LocalBackend, plan_batches
from eagle3.backends.sampling import Sampling, top_p_filter, uniforms
from eagle3.backends.padding import left_pad
from eagle3.common import UserError, read_json
from eagle3.backends.shard import Journal, read_prompts
from eagle3.generate import run_stage
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import load_tokenizer
from support.generate import QUESTIONS, generate, output_bytes, shard_file, stage_params


@pytest.mark.slow
def test_local_smollm2_answers_counts_and_rerun(tmp_path, smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = shard_file(tmp_path, tokenizer)
    params = stage_params(tmp_path, "generate.max_new_tokens=16", "backend.batch_size=2")
    shard = generate(tmp_path, smollm2_dir, prompts, params)

    assert [r["prompt_id"] for r in shard.records] == [p["id"] for p in read_prompts(prompts)]
    by_question = {r["messages"][0]["content"]: r for r in shard.records}
    assert "Paris" in by_question[QUESTIONS[0]]["messages"][-1]["content"]
    for record in shard.records:
        answer = record["messages"][-1]
        assert answer["role"] == "assistant" and len(answer["content"].split()) >= 3 and answer["reasoning_content"] is None
        assert record["prompt_tokens"] == len(prompt_ids(tokenizer, record["messages"][:-1]))
        if record["finish_reason"] == "length":
            assert record["completion_tokens"] == 16
        else:  # the stop token is counted, not shown
            assert record["finish_reason"] == "stop" and record["completion_tokens"] <= 16
    assert shard.stats["completion_tokens"] == sum(r["completion_tokens"] for r in shard.records)
    assert read_json(tmp_path / "out.json") == read_json(tmp_path / "out" / "stats.json") == shard.stats
    meta = read_json(tmp_path / "out" / "meta.json")
    assert (meta["verifier"], meta["verifier_build"]) == (read_json(smollm2_dir / "identity.json")["id"], read_json(smollm2_dir / "meta.json")["build"]["id"])

    (journal,) = (tmp_path / "journal").iterdir()
    journal.unlink()  # the rerun generates everything again
    generate(tmp_path, smollm2_dir, prompts, params, out="again")
    assert output_bytes(tmp_path / "again") == output_bytes(tmp_path / "out")


def test_answer_counts_the_stop_token_once(tiny_verifier_dir):
    backend = LocalBackend.__new__(LocalBackend)  # only the tokenizer-side fields matter here
    backend.tokenizer, backend.eos_ids, backend.stop_strings = load_tokenizer(tiny_verifier_dir), {2}, []
    backend.generation = OmegaConf.create({"think_tags": ["<think>", "</think>"]})
    request = Request("r", "p", [], [1, 2, 3], 0)
    stopped = backend.to_answer(request, [28, 29, 2, 2, 2])  # stop, then padding
    assert (stopped.finish_reason, stopped.completion_tokens, stopped.prompt_tokens) == ("stop", 3, 3)
    assert "<|im_end|>" not in stopped.content
    cut = backend.to_answer(request, [28, 29, 30])
    assert (cut.finish_reason, cut.completion_tokens) == ("length", 3)


def test_batches_are_sorted_by_length_and_fixed_by_the_shard():
    requests = [Request(str(i), str(i), [], [0] * n, 0) for i, n in enumerate([5, 1, 3, 1])]
    assert [[r.id for r in b] for b in plan_batches(requests, 3)] == [["1", "3", "2"], ["0"]]


def test_token_budget_gives_long_prompts_smaller_batches_and_padding_rounds_widths():
    requests = [Request(str(i), str(i), [], [0] * n, 0) for i, n in enumerate([10, 20, 300, 310, 5])]
    def lengths(*args, **kwargs):
        return [[len(r.prompt_ids) for r in b] for b in plan_batches(requests, *args, **kwargs)]

    assert lengths(8, 800, 100) == [[5, 10, 20], [300], [310]]  # [300, 310] would need 2 x (310 + 100) > 800
    assert lengths(2) == [[5, 10], [20, 300], [310]]  # no budget: batch_size alone
    assert lengths(8, 360, 100) == [[5, 10, 20], [300], [310]]  # 3 x (20 + 100) = 360 fits
    assert lengths(8, 360, 100, pad_multiple=64) == [[5, 10], [20], [300], [310]]  # 3 x (64 + 100) does not
    input_ids, mask = left_pad([[7, 8], [9]], pad_id=0, multiple=4)
    assert input_ids.tolist() == [[0, 0, 7, 8], [0, 0, 0, 9]] and mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]


@pytest.mark.slow
def test_greedy_answers_do_not_depend_on_batch_size_budget_or_padding(tmp_path, tiny_verifier_dir):
    """CPU fp32: the speed knobs change batches and padding, never an answer."""
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer)
    plain = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, "generate.max_new_tokens=6"), "a")
    knobs = ["generate.max_new_tokens=6", "backend.batch_size=2", "backend.batch_tokens=200", "backend.pad_multiple=64"]
    fast = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, *knobs), "b")
    assert [r["messages"] for r in fast.records] == [r["messages"] for r in plain.records]


def test_sampling_is_seeded_per_record_not_per_batch(tmp_path, tiny_verifier_dir):
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer)
    sample = ["generate.max_new_tokens=6", "generate.temperature=1.0"]  # top_p is tested on its own
    batched = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, *sample, "backend.batch_size=3"), "a")
    alone = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, *sample, "backend.batch_size=1"), "b")
    greedy = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, "generate.max_new_tokens=6"), "c")
    answers = [[r["messages"][-1]["content"] for r in s.records] for s in (batched, alone, greedy)]
    assert answers[0] == answers[1] != answers[2]
    assert len({r["generation"]["seed"] for r in batched.records}) == 3


def test_samples_are_records_of_their_own_and_answer_0_is_the_single_answer(tmp_path, tiny_verifier_dir):
    """generate.samples=3: per prompt answer 0 (greedy: byte for byte the samples=1 record) and two answers
    sampled at the cycle's temperatures, each with its own id and seed, reproducible; a skipped prompt is
    one skip record for all three."""
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer, [*QUESTIONS, "word " * 80])
    short = ["generate.max_new_tokens=6", "model.max_position_embeddings=64"]
    single = generate(tmp_path, tiny_verifier_dir, prompts, stage_params(tmp_path, *short), "single")
    params = stage_params(tmp_path, *short, "generate.samples=3")
    several = generate(tmp_path, tiny_verifier_dir, prompts, params, "several")

    lines = (tmp_path / "several" / "records.jsonl").read_bytes().splitlines(keepends=True)
    assert lines[::3] == (tmp_path / "single" / "records.jsonl").read_bytes().splitlines(keepends=True)
    assert [r["prompt_id"] for r in several.records] == [r["prompt_id"] for r in single.records for _ in range(3)]
    assert len({r["id"] for r in several.records}) == len({r["generation"]["seed"] for r in several.records}) == 9
    assert [(r["generation"].get("sample", 0), r["generation"]["temperature"]) for r in several.records[:3]] == [
        (0, 0.0), (1, 0.7), (2, 1.0)]
    for greedy, *sampled in zip(*[iter(several.records)] * 3):
        assert all(s["messages"][-1]["content"] != greedy["messages"][-1]["content"] for s in sampled)
    assert (several.stats["samples"], several.stats["answers"], several.stats["skipped"], several.stats["prompts"]) == (3, 9, 1, 4)
    assert (tmp_path / "several" / "skipped.jsonl").read_bytes() == (tmp_path / "single" / "skipped.jsonl").read_bytes()
    assert "samples" not in single.stats and "samples" not in read_json(tmp_path / "single" / "meta.json")["generate"]
    assert read_json(tmp_path / "several" / "meta.json")["generate"]["sample_temperatures"] == [0.7, 1.0]

    run_stage(tiny_verifier_dir, prompts, tmp_path / "again", params, tmp_path / "journal-again", None)  # from scratch
    assert output_bytes(tmp_path / "again") == output_bytes(tmp_path / "several")


def test_top_p_keeps_the_smallest_head_holding_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.equal(top_p_filter(probs.clone(), 0.7), torch.tensor([[0.5, 0.3, 0.0, 0.0]]))
    assert torch.equal(top_p_filter(probs.clone(), 1.0), probs)
    draws = Sampling(temperature=1.0, top_p=0.4)(probs.log().expand(64, 4), torch.arange(64), torch.zeros(64, dtype=torch.long))
    assert draws.eq(0).all()  # the first token alone holds 0.4 of the mass


def test_a_draw_depends_on_its_row_alone_and_follows_the_distribution():
    """A row's token is a function of (its logits, seed, index): the same in a batch of one or of 4,096 beside other
    rows; over many (seed, index) pairs the draws follow softmax(logits / temperature), never a token of mass 0."""
    logits = torch.tensor([2.0, 1.0, 0.0, float("-inf"), -1.0])
    seeds, index = torch.arange(4096) * 7919 + 12345, torch.arange(4096) % 37
    draws = Sampling(temperature=0.7)(logits.expand(4096, 5), seeds, index)
    alone = [Sampling(temperature=0.7)(logits[None], seeds[i : i + 1], index[i : i + 1]).item() for i in range(0, 4096, 97)]
    assert draws[::97].tolist() == alone
    share = torch.bincount(draws, minlength=5).float() / 4096
    assert share[3] == 0 and torch.allclose(share, torch.softmax(logits / 0.7, -1), atol=0.025)
    u = uniforms(torch.tensor([1, 1, 2, 2**40 + 1]), torch.tensor([0, 1, 0, 0]))
    assert len(set(u.tolist())) == 4 and ((0 <= u) & (u < 1)).all()  # index and all 64 seed bits move it
    assert torch.equal(Sampling()(logits.expand(3, 5), seeds[:3], index[:3]), torch.zeros(3, dtype=torch.long))  # greedy


def test_too_long_and_undecodable_prompts_are_skipped_and_recorded(tmp_path, tiny_verifier_dir):
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer, ["Hi.", "word " * 80, "Bye."])
    lines = prompts.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"Bye.", b"By\xffe.")  # raw bytes that are not UTF-8
    lines.append(json.dumps({"id": "lone", "source": "test", "messages": [{"role": "user", "content": "a\ud800b"}]}).encode() + b"\n")
    prompts.write_bytes(b"".join(lines))
    params = stage_params(tmp_path, "generate.max_new_tokens=4", "model.max_position_embeddings=64")
    shard = generate(tmp_path, tiny_verifier_dir, prompts, params)
    assert [s["reason"] for s in shard.skipped] == ["too_long", "invalid_text", "invalid_text"]
    assert "> context 64" in shard.skipped[0]["detail"]
    assert (shard.stats["answers"], shard.stats["skipped"], shard.stats["prompts"]) == (1, 3, 4)
    assert (tmp_path / "out" / "skipped.jsonl").read_text().count("\n") == 3
    (tmp_path / "out" / "records.jsonl").read_text(encoding="utf-8")  # the outputs are valid UTF-8


def test_bad_prompt_lines_name_file_and_line(tmp_path):
    path = tmp_path / "000000-000002.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{"id": "b", "messages": []}\n')
    with pytest.raises(UserError, match=r"000000-000002.jsonl:2: field 'messages'"):
        read_prompts(path)
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{oops\n')
    with pytest.raises(UserError, match=r"000000-000002.jsonl:2: malformed JSON"):
        read_prompts(path)
    path.write_text("\n")
    with pytest.raises(UserError, match="no prompts"):
        read_prompts(path)


class Crash(Exception):
    pass


@pytest.mark.parametrize("samples", [1, 3])
def test_interrupted_run_resumes_from_the_journal_byte_identical(tmp_path, tiny_verifier_dir, monkeypatch, samples):
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer, [f"Question number {i}?" for i in range(5)])
    params = stage_params(tmp_path, "generate.max_new_tokens=5", "backend.batch_size=2", f"generate.samples={samples}")
    reference = run_stage(tiny_verifier_dir, prompts, tmp_path / "reference", params, tmp_path / "reference-journal", None)

    calls = []
    original = Journal.append

    def crash_on_third(self, record):
        calls.append(record["id"])
        if len(calls) == 3:
            raise Crash
        original(self, record)

    monkeypatch.setattr(Journal, "append", crash_on_third)
    with pytest.raises(Crash):
        generate(tmp_path, tiny_verifier_dir, prompts, params)
    monkeypatch.setattr(Journal, "append", original)
    assert not (tmp_path / "out").exists()
    (journal,) = (tmp_path / "journal").iterdir()
    with journal.open("ab") as handle:
        handle.write(b'{"id": "half-writ')  # a kill in the middle of a line
    assert len(Journal(journal).records) == 2

    resumed = generate(tmp_path, tiny_verifier_dir, prompts, params)
    assert resumed.records == reference.records
    assert output_bytes(tmp_path / "out") == output_bytes(tmp_path / "reference")


def test_split_reasoning_variants():
    tags = ["<think>", "</think>"]
    assert split_reasoning("<think> r </think> a", tags) == ("r", "a")
    assert split_reasoning("r</think>a", tags) == ("r", "a")  # the open tag was in the prompt
    assert split_reasoning("<think>cut off", tags) == ("cut off", "")
    assert split_reasoning("plain", tags) == (None, "plain")
    assert split_reasoning("<think>r</think>a", None) == (None, "<think>r</think>a")
