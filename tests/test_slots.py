"""Slot decoding (backends/slots.py): the same greedy answers as transformers ``generate``, CUDA graphs on CUDA."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from support.generate import generate, shard_file, stage_params
from support.models import TINY_LLAMA, cached_import, verifier_model

from eagle3.backends.base import Generation, Request
from eagle3.backends.local import LocalBackend
from eagle3.backends.slot_groups import cache_bytes_per_position, group_requests
from eagle3.backends.slot_kernels import KERNELS, fastest_kernel, masked_attention, split_attention, varlen_attention
from eagle3.backends.slots import Ending, decode_groups
from eagle3.lm.loading import load_tokenizer

LENGTHS = [3, 5, 9, 17, 40, 90, 200, 260, 300, 7, 11]  # two width buckets (256, 512)


def backend(verifier: Path, device: str, dtype: str, max_new_tokens: int, graphs: bool, batch_size: int = 3) -> LocalBackend:
    cfg = OmegaConf.create({"device": device, "dtype": dtype, "threads": 1, "batch_size": batch_size, "batch_tokens": None,
                            "pad_multiple": 1, "cuda_graphs": graphs, "cache_memory": 0.5})
    return LocalBackend(cfg, verifier, Generation("t", max_new_tokens, 0.0, 1.0, 0, None, 1 << 30, (), False, samples=1, sample_temperatures=()))


def random_requests(lengths=LENGTHS) -> list[Request]:
    rng = random.Random(0)
    return [Request(str(i), str(i), [], [rng.randrange(3, 49152) for _ in range(n)], 0) for i, n in enumerate(lengths)]


def answers(local: LocalBackend, requests: list[Request]) -> dict:
    found = {}
    local.run(requests, set(), lambda request, answer: found.__setitem__(request.id, answer))
    return found


def slot_answers(local: LocalBackend, requests: list[Request], batch_size: int, kernel: str) -> dict:
    """Slot decoding on the backend's device, graphs or not (without CUDA the steps run eagerly)."""
    found, max_new_tokens = {}, local.generation.max_new_tokens
    with torch.inference_mode():
        decode_groups(local.model, group_requests(requests, max_new_tokens, batch_size, None),
                      Ending(max_new_tokens, sorted(local.eos_ids), local.pad_id),
                      lambda r, tokens: found.__setitem__(r.id, local.to_answer(r, tokens)), kernel)
    return found


def test_groups_follow_prompt_width_and_small_groups_join_the_next():
    requests = [Request(str(i), str(i), [], [0] * n, 0) for i, n in enumerate([10, 20, 300])]
    groups = group_requests(requests, 100, 2, None)
    assert [([len(r.prompt_ids) for r in g.requests], g.slots, g.length) for g in groups] == [([10, 20], 2, 164), ([300], 1, 420)]
    assert [len(g.requests) for g in group_requests(requests, 100, 4, None)] == [3]  # 2 < 4 slots: joins the 512 bucket
    assert [g.slots for g in group_requests(requests, 100, 8, 400)] == [2, 1]  # 400 // 164 rows, then 400 // 420: one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["flash", "split"])
def test_packed_kernels_read_a_rows_used_keys_as_masked_attention_does(kernel):
    """Flash attention's varlen kernel and the Triton split kernel over each row's used keys (one key, part of
    a slice, whole slices, the whole row) = masked SDPA over the whole row in fp32, bf16."""
    generator = torch.Generator().manual_seed(0)
    n, length, kv_heads, heads, dim = 6, 600, 3, 9, 64
    query = torch.randn(n, heads, dim, generator=generator).cuda().bfloat16()
    cache = [torch.randn(n + 2, length, kv_heads, dim, generator=generator).cuda().bfloat16() for _ in range(2)]
    keys, values = (c[:n] for c in cache)  # a view of a bigger cache's first rows, as slot decoding passes it
    used = torch.tensor([1, 7, 256, 257, 512, 600], dtype=torch.int32, device="cuda")
    if kernel == "split":
        out = split_attention(query, keys, values, used, dim ** -0.5)
    else:
        starts = torch.arange(n + 1, dtype=torch.int32, device="cuda")
        out = varlen_attention(query, keys, values, used, dim ** -0.5, (starts, starts * length))
    expected = masked_attention(query.float(), keys.float(), values.float(), used, dim ** -0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", ["masked", "flash"])
def test_slot_decoding_gives_generate_answers_on_the_cpu(tiny_verifier_dir, kernel):
    """fp32: rows refilled as others finish (3 slots, 11 prompts, a common token as a second EOS) and two
    width groups give every answer of the eager path, in either cache layout (flash's packed one reads each
    row's used keys, a finished row's one key: on the CPU through masked SDPA)."""
    local = backend(tiny_verifier_dir, "cpu", "float32", 12, graphs=True)
    assert not local.slot_decoding  # the CPU keeps generate
    requests = random_requests()
    common = Counter(t for a in answers(local, requests).values() for t in local.tokenizer.encode(a.content)).most_common(1)
    local.eos_ids = {*local.eos_ids, common[0][0]}  # answers now end at different steps
    eager = answers(local, requests)
    assert {a.finish_reason for a in eager.values()} == {"stop", "length"}
    assert slot_answers(local, requests, batch_size=3, kernel=kernel) == eager


def test_the_decode_kernel_is_the_fastest_that_runs_for_the_verifier(tiny_verifier_dir):
    """The CPU (and fp32 anywhere) masks whole rows; a CUDA GPU in bf16 runs the first of KERNELS."""
    assert fastest_kernel(backend(tiny_verifier_dir, "cpu", "float32", 4, graphs=True).model) == "masked"
    if torch.cuda.is_available():
        assert fastest_kernel(backend(tiny_verifier_dir, "cuda", "float32", 4, graphs=True).model) == "masked"
        assert fastest_kernel(backend(tiny_verifier_dir, "cuda", "bfloat16", 4, graphs=True).model) == KERNELS[0]


def test_slot_rows_come_from_memory_on_cuda_and_from_batch_tokens_elsewhere(tiny_verifier_dir):
    """A position's cache is K and V of every layer; the CPU keeps backend.batch_tokens, CUDA takes
    backend.cache_memory of the free memory over that."""
    local = backend(tiny_verifier_dir, "cpu", "float32", 4, graphs=True)
    config = local.model.config
    assert cache_bytes_per_position(local.model) == 2 * config.num_hidden_layers * config.num_key_value_heads * 16 * 4
    local.batch_tokens = 4096
    assert local.slot_cache_tokens() == 4096
    if torch.cuda.is_available():
        on_gpu = backend(tiny_verifier_dir, "cuda", "bfloat16", 4, graphs=True)
        free = torch.cuda.mem_get_info()[0]
        assert abs(on_gpu.slot_cache_tokens() - free // 2 // cache_bytes_per_position(on_gpu.model)) < 2 ** 20


def test_cpu_answers_are_byte_identical_with_cuda_graphs_on_or_off(tmp_path, tiny_verifier_dir):
    """backend.cuda_graphs is an engine setting: the CPU ignores it (the slot path itself is compared with
    generate above), and it enters no record id or recorded setting of the output bytes."""
    tokenizer = load_tokenizer(tiny_verifier_dir)
    prompts = shard_file(tmp_path, tokenizer)
    runs = [generate(tmp_path, tiny_verifier_dir, prompts,
                     stage_params(tmp_path, "generate.max_new_tokens=6", f"backend.cuda_graphs={on}"), f"out-{on}")
            for on in ("true", "false")]
    assert (tmp_path / "out-true" / "records.jsonl").read_bytes() == (tmp_path / "out-false" / "records.jsonl").read_bytes()
    assert runs[0].records and runs[0].stats == runs[1].stats


def test_sampled_answers_decode_in_the_slots_as_generate_draws_them(tiny_verifier_dir):
    """generate.samples: the greedy answers 0 and the sampled answers 1 (own seed and temperature) both go to the
    slots, and every answer is what slot decoding off (transformers generate) gives: both paths draw by the seed."""
    local = backend(tiny_verifier_dir, "cpu", "float32", 8, graphs=True)
    local.generation = replace(local.generation, top_p=0.9)  # the nucleus filter too
    greedy = random_requests(LENGTHS[:4])
    sampled = [replace(r, id=f"{r.id}-1", seed=i + 1, temperature=1.0, sample=1) for i, r in enumerate(greedy)]
    eager = answers(local, greedy + sampled)  # the CPU keeps generate
    slotted, run_slots = [], local.run_slots
    local.run_slots = lambda requests, done: (slotted.extend(r.id for r in requests), run_slots(requests, done))
    local.slot_decoding = True  # as on CUDA (without it the slot steps run eagerly)
    assert answers(local, greedy + sampled) == eager and slotted == [r.id for r in greedy + sampled]
    assert all(eager[s.id].content != eager[g.id].content for g, s in zip(greedy, sampled))


def test_a_sliding_window_shorter_than_a_group_decodes_that_group_and_the_rest_eagerly(smollm2_dir, caplog):
    """A Mistral-style window of 300 tokens: the group of prompts up to 256 tokens (256 + 12 of cache) fits
    it and is slot-decoded; the 512-wide group refuses at its first forward and is answered by generate,
    where the window matters (prompts of 300 tokens): every answer is the eager path's, and the log says why."""
    config = {**TINY_LLAMA, "model_type": "mistral", "sliding_window": 300, "tie_word_embeddings": False}
    verifier = cached_import("tiny-mistral-window-300", verifier_model(name="tiny-mistral-window-300", copy_weights=True, source={
        "kind": "random", "tokenizer": str(smollm2_dir), "config": config, "seed": 0, "dtype": "float32"}))
    local = backend(verifier, "cpu", "float32", 12, graphs=True)
    requests = random_requests()
    eager = answers(local, requests)
    slotted, run_slots = [], local.run_slots
    local.run_slots = lambda requests, done: run_slots(requests, lambda r, a: (slotted.append(r.id), done(r, a)))
    local.slot_decoding = True  # as on CUDA
    assert answers(local, requests) == eager and not local.slot_decoding
    assert sorted(slotted, key=int) == [r.id for r in requests if len(r.prompt_ids) <= 256]
    assert "decoding the rest eagerly: the verifier's attention needs softcapping, sinks or a sliding window" in caplog.text


def generated_tokens(local: LocalBackend, requests: list[Request]) -> dict[str, list[int]]:
    """Each request's generated tokens up to its first stop token (what the backend hands to_answer, padding cut)."""
    found, to_answer = {}, local.to_answer

    def recording(request: Request, tokens: list[int]):
        stop = next((i for i, t in enumerate(tokens) if t in local.eos_ids), len(tokens) - 1)
        found[request.id] = tokens[: stop + 1]
        return to_answer(request, tokens)

    local.to_answer = recording
    local.run(requests, set(), lambda request, answer: None)
    return found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("kernel", "dtype", "compared", "share"),
                         [("masked", "float32", 32, 0.9), ("flash", "bfloat16", 4, 0.6), ("split", "bfloat16", 4, 0.6)],
                         ids=["masked-fp32", "flash-bf16", "split-bf16"])
def test_cuda_graph_decoding_replays_graphs_and_agrees_with_eager_generate(tiny_verifier_dir, kernel, dtype, compared, share):
    """CUDA: greedy tokens equal the eager path's for most prompts, and the steps are graph replays. A random
    model's logits are near-ties everywhere (the top two of 49,152 are ~0.2 sigma apart), so bf16 (the only
    dtype flash attention takes) is compared on the first tokens; fp32 on whole answers."""
    requests = random_requests(LENGTHS * 3)
    eager = generated_tokens(backend(tiny_verifier_dir, "cuda", dtype, 32, graphs=False), requests)
    graphs = backend(tiny_verifier_dir, "cuda", dtype, 32, graphs=True, batch_size=8)
    graphs.decode_kernel = kernel
    assert graphs.slot_decoding
    fast = generated_tokens(graphs, requests)
    assert graphs.graph_replays >= 32
    assert fast.keys() == eager.keys()
    same = sum(fast[k][:compared] == eager[k][:compared] for k in eager)
    assert same >= share * len(eager), f"{same} of {len(eager)} answers identical in their first {compared} tokens"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_answers_are_drawn_inside_the_graphs_as_generate_draws_them(tiny_verifier_dir):
    """CUDA, fp32: sampled requests (temperature 1, top_p 0.9: the nucleus filter too) decode as graph replays, the
    draw captured in the step, and their whole answers equal the eager path's for most prompts (the same seeded draw
    over near-identical logits)."""
    requests = [replace(r, seed=1000 + i, temperature=1.0) for i, r in enumerate(random_requests(LENGTHS * 3))]
    eager, graphs = (backend(tiny_verifier_dir, "cuda", "float32", 32, graphs=on, batch_size=8) for on in (False, True))
    for local in (eager, graphs):
        local.generation = replace(local.generation, top_p=0.9)
    graphs.decode_kernel = "masked"
    want, fast = generated_tokens(eager, requests), generated_tokens(graphs, requests)
    assert graphs.graph_replays >= 32 and fast.keys() == want.keys()
    same = sum(fast[k] == want[k] for k in want)
    assert same >= 0.9 * len(want), f"{same} of {len(want)} sampled answers identical"
