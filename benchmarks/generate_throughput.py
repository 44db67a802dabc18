"""Benchmark of the ``generate`` stage: generated tokens/s of the ways to answer one set of prompts.

    python benchmarks/generate_throughput.py --verifier models/verifier --prompts data/prompts/shards/000032-001000.jsonl \\
        --device cuda --count 1000 --max-new-tokens 2048 --json benchmarks/results/generate.json     # one H200, < 8 min
    python benchmarks/generate_throughput.py --random-shape smollm2-135m --device cuda --count 256   # no data at all
    python benchmarks/generate_throughput.py --verifier models/verifier --prompts data/prompts/shards/000000-000032.jsonl \\
        --count 16 --slow-count 16 --batch-size 16 --max-new-tokens 64 --threads 1                   # the CPU
    python benchmarks/generate_throughput.py --verifier models/verifier --prompts data/prompts/shards/000000-000032.jsonl \\
        --modes openai --base-url http://127.0.0.1:8000/v1 --concurrency 4
    python benchmarks/generate_throughput.py --smoke      # the CPU, a tiny random verifier: seconds (tests run it)

Modes, on the same prompts (the shard's first ones under the chat template, or with ``--random-shape``
random token prompts of shard-like lengths and a random-weights model of that shape, written to a
temporary folder: it never stops early, so every mode does the same work):

- ``after``: the ``local`` backend now: on CUDA, slot decoding with CUDA graphs (backends/slots.py), its
  decode attention the fastest kernel that runs (``split``: Triton, each row's used keys split across
  programs);
- ``after_varlen``: the same with the ``flash`` kernel (flash attention's varlen kernel over each row's
  used keys), ``after_masked`` with ``masked`` (SDPA over whole rows, masked: the default until the
  eighth lease);
- ``after_compiled``: ``after_varlen`` with the slot decode step compiled by ``torch.compile`` (dynamic
  slot count) before its CUDA graphs are captured, so inductor's fused kernels replace most of the
  step's ~1,200 launches (experimental); its first pass pays the compilation, cold;
- ``after_compiled_cached``: the same again in a new process, whose compilation reads what the first
  wrote to inductor's on-disk cache: what the second and later shards of one ``dvc repro`` would see;
- ``before``: the ``local`` backend's eager path (``backend.cuda_graphs: false``: transformers
  ``generate`` on sorted, left-padded batches, cuDNN SDPA off), what CUDA ran before;
- ``generate``: plain transformers ``generate`` on the same sorted, left-padded batches;
- ``generate_batch``: transformers' continuous batching (paged attention) over all prompts;
- ``openai``: the stage's core (``generate_shard``) against an OpenAI-compatible server;
- ``ties``: not a speed: where ``after`` and ``before`` first differ (``after_varlen`` and ``after``,
  ``after_compiled`` and ``after_varlen``), the gap between the two tokens' logits (an eager forward of
  the common prefix): near-ties have small gaps, a bug large ones; with the share of first differences
  under each of ``TIE_GAPS``.

``after_varlen`` and the compiled modes take their own slot count (``--varlen-batch-size``; default
``after``'s ``--batch-size``); on CUDA every slot mode's cache also stays within ``--cache-memory`` of the
free GPU memory (``--batch-tokens`` bounds the eager batches). On
the CPU (the tiny test verifier, fp32) the compiled step gave the same answers as the plain one.

The eager modes are host-bound (every step pays ~30 ms of launches, however few rows): they run on
the first ``--slow-count`` prompts with answers capped at ``--slow-max-new-tokens``, which only
flatters them (fewer idle rows) and keeps the whole run inside ``--budget-s``; ``after`` runs on
``--count`` prompts, answers up to ``--max-new-tokens``. Greedy agreement: the share of the prompts
two modes both answered whose tokens are identical (up to the shorter cap), for the PAIRS.

Each mode runs in its own fresh process (a cold start is per process: whatever runs first in a
process would pay it for the others); one that fails prints its traceback and the others still
run; one that would overrun the budget is stopped. ``first`` is the first pass of that process
(what a ``dvc repro`` of a shard experiences: graph capture included); ``warm`` is the median of
``--runs`` further passes. Model loading is excluded. Prints one JSON line per mode, then a table;
``--json`` also writes all of it (commit, command, settings, modes) to a file, after every mode.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from common import commit, environment, random_verifier  # first: this checkout's eagle3, installed or not
from eagle3.launch import die_with_parent
from shapes import VERIFIER_SHAPES

MODES = ["after", "after_varlen", "after_masked", "after_compiled", "after_compiled_cached", "before", "ties", "generate",
         "generate_batch"]  # in the order they run
SMOKE_MODES = ["after", "generate"]  # the local backend as the stage runs it (eager on a CPU) and plain generate
SHARES = {"after": 0.4, "after_varlen": 0.45}  # of the budget left when they start; the others split what is left
PAIRS = [("after", "before"), ("after_varlen", "before"), ("after_varlen", "after"),
         ("after_compiled", "after_varlen")]  # greedy agreement between modes
TIE_PAIRS = [("after", "before"), ("after_varlen", "after"), ("after_compiled", "after_varlen")]  # ``ties``: first differences' logit gaps
TIE_GAPS = [0.125, 0.25, 0.5, 1.0]  # logit gaps counted (bf16 spaces logits of 16-32 by 0.125)
SLOW = {"before", "generate", "generate_batch", "slots_eager", "ties"}  # on --slow-count prompts, answers capped at --slow-max-new-tokens

Answers = dict[str, list[int]]  # request id -> generated tokens up to and including the stop token


def random_prompts(count: int, vocab_size: int) -> list[list[int]]:
    """Token prompts whose lengths spread like a chat shard's (median about 90, 20 to 512)."""
    import random

    rng = random.Random(0)
    lengths = [min(512, max(20, int(rng.lognormvariate(4.5, 0.7)))) for _ in range(count)]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def shard_prompts(verifier: Path, shard: Path, count: int) -> list[list[int]]:
    from eagle3.backends.shard import read_prompts
    from eagle3.lm.chat import prompt_ids
    from eagle3.lm.loading import load_tokenizer

    tokenizer = load_tokenizer(verifier)
    return [prompt_ids(tokenizer, p["messages"]) for p in read_prompts(shard)[:count]]


def timed_passes(one_pass, runs: int, deadline: float) -> tuple[dict, Answers]:
    """Tokens/s of the first pass and the median of ``runs`` more (each pass: seconds, tokens, answers), as many
    as fit before ``deadline`` (time.monotonic()); the first pass's answers."""
    first_s, tokens, answers = one_pass()
    warm = []
    while len(warm) < runs and time.monotonic() + 1.2 * first_s < deadline:
        warm.append(one_pass()[0])
    figures = {"tokens": tokens, "first_s": round(first_s, 2), "first_tok_s": round(tokens / first_s, 1),
               "warm_s": round(statistics.median(warm), 2) if warm else None,
               "warm_tok_s": round(tokens / statistics.median(warm), 1) if warm else None}
    return figures, answers


def progress(start: float, answers: Answers, every_s: float = 10.0):
    """A ``done`` callback printing a partial figure every ``every_s`` s: what a stopped mode still reports."""
    last = [start]

    def done(request, answer) -> None:
        now = time.perf_counter()
        if now - last[0] >= every_s:
            last[0] = now
            tokens = sum(map(len, answers.values()))
            print(json.dumps({"mode": "partial", "answers": len(answers), "tokens": tokens, "seconds": round(now - start, 1),
                              "tok_s": round(tokens / (now - start), 1)}), flush=True)

    return done


def backend_pass(spec: dict, prompts: list[list[int]], max_new_tokens: int, graphs: bool, kernel: str | None = None,
                 compiled: bool = False):
    """One pass of the ``local`` backend as the stage builds it (``graphs``: backend.cuda_graphs; ``kernel``: its
    decode attention instead of the fastest, ``flash`` and ``split`` over ``--varlen-batch-size`` slots; ``compiled``:
    the slot decode step compiled, in this worker process only)."""
    from omegaconf import OmegaConf

    if compiled:
        import torch

        from eagle3.backends import slots

        slots.SlotDecoder.step = torch.compile(slots.SlotDecoder.step, dynamic=True)

    from eagle3.backends.base import Generation, Request
    from eagle3.backends.local import LocalBackend

    own = kernel in ("flash", "split")
    slots = spec["varlen_batch_size"] if own else spec["batch_size"]
    cfg = OmegaConf.create({"device": spec["device"], "dtype": spec["dtype"], "threads": spec["threads"],
                            "batch_size": slots, "batch_tokens": spec["batch_tokens"],
                            "pad_multiple": spec["pad_multiple"], "cuda_graphs": graphs, "cache_memory": spec["cache_memory"]})
    gen = Generation("bench", max_new_tokens, temperature=0.0, top_p=1.0, seed=0, think_tags=None, context=1 << 30, stop=(),
                     trust_remote_code=False, samples=1, sample_temperatures=())  # context: the prompts are token ids, never skipped
    backend = LocalBackend(cfg, Path(spec["verifier"]), gen)
    backend.decode_kernel = kernel
    requests = [Request(str(i), str(i), [], ids, 0) for i, ids in enumerate(prompts)]
    answers: Answers = {}
    to_answer = backend.to_answer

    def recording(request, tokens):  # the raw tokens of each answer, for the agreement check
        answers[request.id] = tokens[: count_until_stop(tokens, backend.eos_ids)]
        return to_answer(request, tokens)

    backend.to_answer = recording

    def one_pass():
        answers.clear()
        start = time.perf_counter()
        backend.run(requests, set(), progress(start, answers))
        synchronize(spec["device"])
        return time.perf_counter() - start, sum(map(len, answers.values())), dict(answers)

    def extras() -> dict:
        found = {"slot_decoding": backend.slot_decoding, "graph_replays": backend.graph_replays}
        if backend.slot_decoding and backend.graph_replays:  # slots_eager captures nothing to time
            found["step_ms"], found["step_kernels"] = step_ms(backend, slots, 256 + max_new_tokens, kernel)
        return found

    return one_pass, extras


def step_ms(backend, slots: int, length: int, kernel: str | None, steps: int = 50) -> tuple[dict, dict]:
    """Milliseconds per replay of the captured decode step over ``slots`` rows of a ``length`` cache, every row
    live at position length / 2 (what the masked attention reads does not depend on it; the others' does), and
    where that step's GPU time goes (``step_kernels``: the same step run eagerly under the profiler)."""
    import traceback

    import torch

    from eagle3.backends.slot_groups import Group
    from eagle3.backends.slot_kernels import fastest_kernel
    from eagle3.backends.slots import Ending, SlotDecoder, slot_attention

    key = f"{slots}x{length}"
    try:
        ending = Ending(backend.generation.max_new_tokens, sorted(backend.eos_ids), backend.pad_id)
        decoder = SlotDecoder(backend.model, Group([], slots, length), ending, kernel or fastest_kernel(backend.model))
        with torch.inference_mode(), slot_attention(backend.model, decoder.cache):
            decoder.capture()
            decoder.positions.fill_(length // 2)
            decoder.done.fill_(False)  # every row live: a finished row reads one key
            graph = decoder.graphs[slots]
            graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            torch.cuda.synchronize()
            replay_ms = round((time.perf_counter() - start) / steps * 1000, 2)
            return {key: replay_ms}, {key: kernel_times(lambda: decoder.step(slots))}
    except Exception:  # a probe, not the measurement: report and go on
        traceback.print_exc()
        return {key: "failed (traceback above)"}, {}


def kernel_times(step, top: int = 12) -> dict:
    """GPU time of one call of ``step`` by kernel (the profiler's self device time): its total, its kernel
    launches and the ``top`` costliest kernels, so a slow step says which of its parts to make faster."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()  # warm: allocations and autotuning stay out of the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                     key=lambda e: e.self_device_time_total, reverse=True)
    return {"device_ms": round(sum(e.self_device_time_total for e in kernels) / 1000, 3),
            "launches": sum(e.count for e in kernels),
            "top": [{"kernel": e.key[:100], "calls": e.count, "ms": round(e.self_device_time_total / 1000, 3)} for e in kernels[:top]]}


def ties(spec: dict, folder: Path) -> dict:
    """``tie_gaps`` of every TIE_PAIRS pair whose answers this run has, by "a/b"."""
    from eagle3.lm.loading import load_verifier

    model = load_verifier(spec["verifier"], spec["device"], spec["dtype"])
    found = {}
    for a, b in TIE_PAIRS:
        files = [folder / f"{mode}.answers.json" for mode in (a, b)]
        if all(f.is_file() for f in files):
            cap = spec["slow_max_new_tokens"] if {a, b} & SLOW else spec["max_new_tokens"]
            found[f"{a}/{b}"] = tie_gaps(model, spec["prompt_ids"], *(json.loads(f.read_text()) for f in files), cap)
    return {"pairs": found}


def tie_gaps(model, prompt_ids: list[list[int]], first: Answers, second: Answers, cap: int) -> dict:
    """Where two modes' answers (up to ``cap`` tokens) first differ, how far apart the two tokens' logits are for
    the verifier (an eager forward of prompt + common prefix): a near-tie has a small gap, a bug a large one."""
    import torch

    from eagle3.backends.padding import left_pad

    cases = []
    for key in sorted(first.keys() & second.keys(), key=int):
        a, b = first[key][:cap], second[key][:cap]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:
            cases.append((prompt_ids[int(key)] + a[:at], a[at], b[at]))
    gaps = []
    with torch.inference_mode():
        for start in range(0, len(cases), 16):
            chunk = cases[start : start + 16]
            input_ids, mask = left_pad([c[0] for c in chunk], 0)
            input_ids, mask = input_ids.to(model.device), mask.to(model.device)
            logits = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                           logits_to_keep=1).logits[:, -1].float()  # [n, V]
            gaps += [abs(row[a] - row[b]).item() for row, (_, a, b) in zip(logits, chunk)]
    gaps.sort()
    return {"compared": len(first.keys() & second.keys()), "differing": len(gaps),
            "gap_median": round(statistics.median(gaps), 3) if gaps else None, "gap_max": round(gaps[-1], 3) if gaps else None,
            "share_under": {str(limit): round(sum(g < limit for g in gaps) / len(gaps), 3) for limit in TIE_GAPS} if gaps else {},
            "gaps": [round(g, 3) for g in gaps]}


def slots_eager_pass(spec: dict, prompts: list[list[int]], max_new_tokens: int):
    """``after`` without graph capture (each step eager): run only when ``after`` failed, to tell a capture
    failure from a slot decoding one."""
    from eagle3.backends.slots import SlotDecoder

    SlotDecoder.capture = lambda self: None
    return backend_pass(spec, prompts, max_new_tokens, graphs=True)


def greedy_model(spec: dict, max_new_tokens: int):
    """(the verifier, its stop ids, a greedy GenerationConfig) for the plain transformers modes."""
    from transformers import GenerationConfig

    from eagle3.lm.loading import load_verifier

    model = load_verifier(spec["verifier"], spec["device"], spec["dtype"])
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    return model, eos, config


def generate_pass(spec: dict, prompts: list[list[int]], max_new_tokens: int):
    """One pass of plain ``generate`` on the backend's batches (sorted by length, left padded)."""
    import torch

    from eagle3.backends.base import Request
    from eagle3.backends.local import plan_batches
    from eagle3.backends.padding import left_pad

    model, eos, config = greedy_model(spec, max_new_tokens)
    batches = plan_batches([Request(str(i), str(i), [], ids, 0) for i, ids in enumerate(prompts)], spec["batch_size"],
                           spec["batch_tokens"], max_new_tokens, spec["pad_multiple"])

    @torch.inference_mode()
    def one_pass():
        answers: Answers = {}
        start = time.perf_counter()
        for batch in batches:
            input_ids, mask = left_pad([r.prompt_ids for r in batch], eos[0], spec["pad_multiple"])
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device),
                                 generation_config=config)
            for request, row in zip(batch, out[:, input_ids.shape[1]:].tolist()):
                answers[request.id] = row[: count_until_stop(row, eos)]
        synchronize(spec["device"])
        return time.perf_counter() - start, sum(map(len, answers.values())), answers

    return one_pass, dict


def generate_batch_pass(spec: dict, prompts: list[list[int]], max_new_tokens: int):
    """One pass of transformers' continuous batching over all prompts at once."""
    model, eos, config = greedy_model(spec, max_new_tokens)

    def one_pass():
        start = time.perf_counter()
        outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        synchronize(spec["device"])
        seconds = time.perf_counter() - start
        answers = {key: list(o.generated_tokens)[: count_until_stop(list(o.generated_tokens), eos)] for key, o in outputs.items()}
        return seconds, sum(map(len, answers.values())), answers

    return one_pass, dict


def openai_pass(spec: dict):
    """One pass of the stage's core against a server: prompts as chats, so it needs a shard."""
    from omegaconf import OmegaConf

    from eagle3.backends.by_name import make_backend
    from eagle3.backends.base import Generation
    from eagle3.config import compose_params
    from eagle3.backends.shard import Asking, Journal, generate_shard, generation_params, read_prompts
    from eagle3.lm.loading import load_tokenizer
    from eagle3.lm.spec import VerifierSpec

    scratch = Path(tempfile.mkdtemp())
    compose_params(["backend=openai", f"backend.base_urls=[{spec['base_url']}]", f"backend.concurrency={spec['concurrency']}",
                    f"generate.max_new_tokens={spec['max_new_tokens']}"], output=scratch / "params.yaml")
    params = OmegaConf.load(scratch / "params.yaml")
    tokenizer = load_tokenizer(spec["verifier"])
    prompts = read_prompts(Path(spec["prompts"]))[: spec["count"]]
    model = VerifierSpec.from_params(params.model)
    generation = Generation.from_params(params.generate, model)
    record_params = generation_params(generation, "openai")

    def one_pass():
        journal = Journal(Path(tempfile.mkdtemp(dir=scratch)) / "journal.jsonl")  # empty: every pass answers all
        backend = make_backend(params.backend, Path(spec["verifier"]), generation, model)
        start = time.perf_counter()
        asking = Asking(tokenizer=tokenizer, generation=generation, record_params=record_params, verifier="bench")
        shard = generate_shard("bench", prompts, backend, asking, journal)
        return time.perf_counter() - start, shard.stats["completion_tokens"], {}  # no token ids from a server

    return one_pass


def count_until_stop(tokens: list[int], eos) -> int:
    """Generated tokens up to and including the first stop token, as the backend counts them."""
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def worker(spec_path: Path, mode: str, answers_path: Path, seconds: float) -> None:
    """One mode in this (fresh) process with ``seconds`` to run: print its JSON line, write its first pass's answers."""
    import logging

    import torch

    deadline = time.monotonic() + seconds
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the slot decoder's per-group lines
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(spec["threads"])
    if mode == "ties":
        print(json.dumps({"mode": mode, **ties(spec, spec_path.parent)}), flush=True)
        return
    slow = mode in SLOW
    prompts = spec["prompt_ids"][: spec["slow_count"] if slow else spec["count"]]
    max_new_tokens = spec["slow_max_new_tokens"] if slow else spec["max_new_tokens"]
    start = time.perf_counter()
    one_pass, extras = {
        "after": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=True),
        "after_varlen": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=True, kernel="flash"),
        "after_masked": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=True, kernel="masked"),
        "after_compiled": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=True, kernel="flash", compiled=True),
        "after_compiled_cached": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=True, kernel="flash", compiled=True),
        "slots_eager": lambda: slots_eager_pass(spec, prompts, max_new_tokens),
        "before": lambda: backend_pass(spec, prompts, max_new_tokens, graphs=False),
        "generate": lambda: generate_pass(spec, prompts, max_new_tokens),
        "generate_batch": lambda: generate_batch_pass(spec, prompts, max_new_tokens),
        "openai": lambda: (openai_pass(spec), dict),
    }[mode]()
    load_s = time.perf_counter() - start
    figures, answers = timed_passes(one_pass, spec["runs"], deadline)
    answers_path.write_text(json.dumps(answers))
    row = {"mode": mode, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "load_s": round(load_s, 2), **figures}
    if torch.cuda.is_available() and spec["device"].startswith("cuda"):  # the passes' peak, before extras' step probe
        row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    row.update(extras())
    print(json.dumps(row), flush=True)


def agreement(after: Answers, before: Answers, cap: int) -> dict:
    """How many prompts answered by both have the same greedy tokens, compared up to ``cap`` tokens."""
    common = sorted(after.keys() & before.keys(), key=int)
    same = [after[k][:cap] == before[k][:cap] for k in common]
    diverge = [next(i for i, (a, b) in enumerate(zip(after[k][:cap] + [-1], before[k][:cap] + [-2])) if a != b)
               for k, ok in zip(common, same) if not ok]
    return {"prompts": len(common), "identical": sum(same), "identical_share": round(sum(same) / max(len(common), 1), 3),
            "first_difference_at": sorted(diverge)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, help="verifier folder (models/verifier); not with --random-shape")
    parser.add_argument("--prompts", type=Path, help="a prompt shard (data/prompts/shards/X.jsonl)")
    parser.add_argument("--random-shape", choices=sorted(VERIFIER_SHAPES), help="random weights of this shape, random token prompts")
    parser.add_argument("--modes", nargs="+", choices=[*MODES, "openai", "slots_eager"], default=MODES)
    parser.add_argument("--count", type=int, default=1000, help="prompts of `after`, `after_varlen` (and openai)")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="their answer cap")
    parser.add_argument("--slow-count", type=int, default=64, help="prompts of the eager modes")
    parser.add_argument("--slow-max-new-tokens", type=int, default=256, help="answer cap of the eager modes")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=512, help="backend.batch_size (slots of `after`)")
    parser.add_argument("--batch-tokens", type=int, default=1_500_000, help="backend.batch_tokens (KV-cache tokens of the eager modes)")
    parser.add_argument("--cache-memory", type=float, default=0.8, help="backend.cache_memory (slot decoding's share of free GPU memory)")
    parser.add_argument("--varlen-batch-size", type=int, help="after_varlen's backend.batch_size (default: --batch-size)")
    parser.add_argument("--pad-multiple", type=int, default=64, help="backend.pad_multiple (eager modes)")
    parser.add_argument("--runs", type=int, default=1, help="warm passes after the first (median)")
    parser.add_argument("--budget-s", type=float, default=420,  # 225 s left the eager modes 26-38 s: none finished
                        help="stop a mode that would end later than this")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--commit", help="the commit measured (default: the checkout's; where the tree has no .git)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai")
    parser.add_argument("--concurrency", type=int, default=4, help="openai")
    parser.add_argument("--smoke", action="store_true", help=f"the CPU, a tiny random verifier, {' '.join(SMOKE_MODES)} on 4 "
                        "prompts of 8 new tokens: seconds (tests/test_benchmarks.py runs it)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--answers", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.random_shape, args.device, args.modes, args.threads = "tiny", "cpu", SMOKE_MODES, 1
        args.count = args.slow_count = args.batch_size = 4
        args.max_new_tokens = args.slow_max_new_tokens = 8
    if args.worker:
        worker(args.spec, args.worker, args.answers, args.seconds)
        return
    if bool(args.random_shape) == bool(args.verifier and args.prompts):
        parser.error("give either --verifier and --prompts, or --random-shape")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_shape:
            shape = VERIFIER_SHAPES[args.random_shape]
            verifier = random_verifier(shape, Path(tmp) / "verifier", args.device, name=f"random-{args.random_shape}")
            prompt_ids = random_prompts(max(args.count, args.slow_count), shape["vocab_size"])
        else:
            verifier, prompt_ids = args.verifier, shard_prompts(args.verifier, args.prompts, max(args.count, args.slow_count))
        spec = {"verifier": str(verifier), "prompts": str(args.prompts), "prompt_ids": prompt_ids, "count": args.count,
                "slow_count": args.slow_count, "slow_max_new_tokens": args.slow_max_new_tokens,
                "device": args.device, "dtype": args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"),
                "threads": args.threads, "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                "batch_tokens": args.batch_tokens, "varlen_batch_size": args.varlen_batch_size or args.batch_size,
                "pad_multiple": args.pad_multiple, "runs": args.runs,
                "cache_memory": args.cache_memory,
                "base_url": args.base_url, "concurrency": args.concurrency}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        settings = {k: v for k, v in spec.items() if k not in ("prompt_ids", "base_url", "concurrency")}
        report = {"commit": args.commit or commit(), "command": " ".join(sys.argv), "shape": args.random_shape,
                  "prompt_tokens": sum(map(len, prompt_ids[: args.count])), **settings, **environment(args.device),
                  "budget_s": args.budget_s, "modes": [],
                  "note": f"eager modes ({', '.join(sorted(SLOW))}) ran on the first {args.slow_count} prompts, answers capped at "
                          f"{args.slow_max_new_tokens} tokens, to fit the budget; after and after_varlen on {args.count}, up to {args.max_new_tokens}; "
                          "slots_eager runs only when after fails"}
        answers: dict[str, Answers] = {}
        modes = list(args.modes)
        while modes:
            mode = modes.pop(0)
            left = args.budget_s - (time.monotonic() - started)
            share = SHARES.get(mode, 0) if modes else 1.0
            share = max(share, 1 / (len(modes) + 1))
            if mode == "ties" and not any(answers.get(a) and answers.get(b) for a, b in TIE_PAIRS):
                row, answers[mode] = {"mode": mode, "error": f"skipped: needs the answers of one of {TIE_PAIRS}"}, {}
            else:
                row, answers[mode] = run_mode(mode, Path(tmp), left * share)
            report["modes"].append(row)
            if mode == "after" and row.get("error", "").startswith("failed"):
                modes.insert(0, "slots_eager")
            report["agreement"] = {
                f"{a}/{b}": agreement(answers[a], answers[b], args.slow_max_new_tokens if b in SLOW else args.max_new_tokens)
                for a, b in PAIRS if answers.get(a) and answers.get(b)}
            report["total_s"] = round(time.monotonic() - started, 1)
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


def print_table(report: dict) -> None:
    print(f"{'mode':<22}{'prompts':>8}{'max new':>8}{'tokens':>10}{'first s':>9}{'first tok/s':>13}{'warm tok/s':>12}")
    for row in report["modes"]:
        print(f"{row['mode']:<22}{row.get('prompts', '-'):>8}{row.get('max_new_tokens', '-'):>8}{row.get('tokens', '-'):>10}"
              f"{row.get('first_s', '-'):>9}{row.get('first_tok_s', '-'):>13}{row.get('warm_tok_s') or '-':>12}"
              + (f"  {row['error']}" if "error" in row else "")
              + (f"  graph replays {row['graph_replays']}" if row.get("graph_replays") else "")
              + "".join(f"  step {shape}: {ms} ms" for shape, ms in row.get("step_ms", {}).items())
              + "".join(f"  {pair}: {gaps['differing']} of {gaps['compared']} differ, logit gap median {gaps['gap_median']}, "
                        f"max {gaps['gap_max']}" for pair, gaps in row.get("pairs", {}).items()))
    for pair, a in report.get("agreement", {}).items():
        print(f"greedy agreement {pair}: {a['identical']}/{a['prompts']} identical ({a['identical_share']})")
    print(f"total {report.get('total_s')} s")


def run_mode(mode: str, folder: Path, seconds_left: float) -> tuple[dict, Answers]:
    """One mode in a fresh interpreter (its traceback, if any, goes to stderr); a mode that fails or
    runs past ``seconds_left`` is reported, the others still run."""
    answers_path = folder / f"{mode}.answers.json"
    command = [sys.executable, __file__, "--worker", mode, "--spec", str(folder / "spec.json"), "--answers", str(answers_path),
               "--seconds", str(seconds_left)]
    if seconds_left < 5:
        row = {"mode": mode, "error": "skipped: no budget left"}
    else:
        try:
            # SIGKILL when this benchmark ends, however it ends: no mode runs on unwatched
            result = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=seconds_left,
                                    preexec_fn=partial(die_with_parent, signal.SIGKILL))
            lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"mode"')]
            row = lines[-1] if lines and not result.returncode else {
                "mode": mode, "error": f"failed (exit {result.returncode}): traceback above", "last": lines[-1:]}
        except subprocess.TimeoutExpired as stopped:
            output = stopped.stdout.decode() if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
            lines = [json.loads(line) for line in output.splitlines() if line.startswith('{"mode"')]
            row = {"mode": mode, "error": f"stopped at its share of the budget ({seconds_left:.0f} s)", "last": lines[-1:]}
    print(json.dumps(row), flush=True)
    return row, json.loads(answers_path.read_text()) if answers_path.is_file() and "error" not in row else {}


if __name__ == "__main__":
    main()
