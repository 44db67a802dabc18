"""Benchmark of the ``extract`` stage: verifier throughput, stored bytes per token, DVC commit cost.

    python benchmarks/extract_throughput.py models/verifier            # or .eagle3/cache/smollm2-135m
    python benchmarks/extract_throughput.py models/verifier --runs 3 --samples 16 --tokens 512 --dvc-gb 1
    python benchmarks/extract_throughput.py models/verifier --device cuda --compute-dtype bfloat16 \
        --random-shape llama3-8b --workers 1 2          # 8B-shaped random weights; 1 and 2 GPUs
    python benchmarks/extract_throughput.py .eagle3/cache/tiny-random --smoke     # a tiny verifier: seconds

Its ``model`` params (taps, chat rules) are the current folder's params.yaml.

Prints, as medians over ``--runs``:
- the verifier forward's tokens/s alone (the ceiling: taps gathered, nothing stored);
- extraction tokens/s of ``eagle3.hidden_states.capture.extract_samples`` (render excluded; forward, encode,
  checks and safetensors writes included) for bf16 and fp8 storage;
- bytes per token actually written (parts only) next to ``bytes_per_token`` of the preflight;
- ``dvc add`` time per GB of hidden-state parts (hash + move to cache + link) in a temporary
  repository with ``cache.type hardlink``: the cost DVC adds when it commits extract's output;
- with ``--workers``, the data-parallel scaling of ``run_workers`` (``layout.extract_workers``
  processes, worker r on cuda:r): wall time including spawn and model load, tokens/s, and the
  efficiency against one worker.

``--random-shape llama3-8b`` replaces the verifier's weights by random ones of Llama-3.1-8B's
shape (saved once into a temporary folder with the verifier's tokenizer): what matters for
throughput is the shape, and no 8B checkpoint is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from common import random_verifier
from eagle3.hidden_states.storage import bytes_per_token
from eagle3.hidden_states.capture import Settings, batches, extract_samples, hidden_states
from eagle3.hidden_states.samples import prepare
from eagle3.hidden_states.workers import Job, run_workers
from eagle3.lm.loading import WHOLE_COPY, load_tokenizer, load_verifier
from eagle3.lm.spec import VerifierSpec
from shapes import VERIFIER_SHAPES

TEXT = (
    "Speculative decoding lets a small draft model propose several tokens that the large verifier "
    "checks in one forward pass; accepted tokens are kept and the first rejected one is resampled. "
)


def conversations(count: int, tokens: int) -> list[dict]:
    """``count`` single-turn conversations of about ``tokens`` tokens each (answer ≈ 90%)."""
    words = TEXT.split()
    records = []
    for i in range(count):
        answer = " ".join(words[(i + k) % len(words)] for k in range(int(tokens * 0.9 * 0.75)))
        messages = [{"role": "user", "content": f"Explain speculative decoding, variant {i}."},
                    {"role": "assistant", "content": answer, "reasoning_content": None}]
        records.append({"id": f"{i:016x}", "messages": messages})
    return records


def time_extraction(model, samples, settings: Settings, pad_id: int) -> tuple[float, int]:
    """(seconds, bytes written) of one extraction into a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        extract_samples(model, samples, settings, Path(folder), pad_id)
        seconds = time.perf_counter() - start
        written = sum(f.stat().st_size for f in Path(folder).iterdir())
    return seconds, written


def time_workers(verifier: Path, samples, settings: Settings, counts: list[int], pad_id: int) -> dict:
    """Wall time of ``run_workers`` (spawn, load, extract, write) for each worker count, bf16 storage.

    Each count also runs once on one sample per worker: that wall time is the start-up (process
    spawn, imports, model load), and ``steady_tokens_per_s`` is what remains after it.
    """
    tokens = sum(len(s.input_ids) for s in samples)
    results = {}
    for workers in counts:
        startup, seconds = (run_seconds(verifier, part, dataclasses.replace(settings, workers=workers), pad_id)
                            for part in (samples[:workers], samples))  # one sample each, then all
        results[workers] = {"wall_s": round(seconds, 1), "startup_s": round(startup, 1),
                            "tokens_per_s": round(tokens / seconds, 1), "steady_tokens_per_s": round(tokens / (seconds - startup), 1)}
    one = results[counts[0]]
    for workers, row in results.items():  # 1.0: n workers take 1/n of the time of counts[0] workers
        row["efficiency"] = round(row["tokens_per_s"] / one["tokens_per_s"] * counts[0] / workers, 3)
        row["steady_efficiency"] = round(row["steady_tokens_per_s"] / one["steady_tokens_per_s"] * counts[0] / workers, 3)
    return results


def run_seconds(verifier: Path, samples, settings: Settings, pad_id: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        run_workers(Job(verifier, settings, Path(folder), False, pad_id), samples)
        return time.perf_counter() - start


def time_forward(model, samples, settings: Settings, pad_id: int) -> float:
    """Seconds of the verifier forwards alone (taps gathered, nothing encoded, checked or written)."""
    start = time.perf_counter()
    for batch in batches(samples, settings.batch_tokens):
        hidden_states(model, batch, settings.aux_layers, pad_id)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def dvc_add_seconds(gigabytes: float, part_bytes: int) -> float:
    """Seconds of ``dvc add`` on ``gigabytes`` of part-sized files in a fresh hardlink-cache repo."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with tempfile.TemporaryDirectory() as repo:
        for command in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "cache.type", "hardlink"]):
            subprocess.run(command, cwd=repo, env=env, check=True)
        shard = Path(repo) / "data" / "hidden_states" / "000000-001000"
        shard.mkdir(parents=True)
        rng = np.random.default_rng(0)
        for n in range(max(1, round(gigabytes * 1e9 / part_bytes))):
            (shard / f"part-{n:06d}.safetensors").write_bytes(rng.integers(0, 256, part_bytes, dtype=np.uint8).tobytes())
        size = sum(f.stat().st_size for f in shard.iterdir())
        start = time.perf_counter()
        subprocess.run(["dvc", "add", "-q", str(shard.relative_to(repo))], cwd=repo, env=env, check=True)
        return (time.perf_counter() - start) / (size / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path, help="the SmolLM2 verifier folder (models/verifier)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512, help="approximate tokens per sample")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compute-dtype", default="float32", help="float32 on CPU (bf16 is slower there)")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--dvc-gb", type=float, default=1.0, help="GB of parts for the dvc add timing (0: skip)")
    parser.add_argument("--random-shape", choices=["llama3-8b"], help="random weights of this shape, the verifier's tokenizer")
    parser.add_argument("--workers", type=int, nargs="*", default=[], help="also time run_workers with these worker counts")
    parser.add_argument("--smoke", action="store_true", help="one run of 2 short samples, one worker, no dvc add: seconds "
                        "on a tiny verifier (tests/test_benchmarks.py runs it)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.samples, args.tokens, args.threads, args.workers, args.dvc_gb = 1, 2, 48, 1, [1], 0

    torch.set_num_threads(args.threads)
    params = OmegaConf.load("params.yaml")
    tokenizer = load_tokenizer(args.verifier)
    samples, _ = prepare(conversations(args.samples, args.tokens), tokenizer, VerifierSpec.from_params(params.model).chat.for_tokenizer(tokenizer), 8192)
    tokens = sum(len(s.input_ids) for s in samples)
    with tempfile.TemporaryDirectory() as scratch:
        verifier = args.verifier
        if args.random_shape:  # the shape's weights, the verifier's tokenizer (the samples are rendered by its template)
            verifier = random_verifier(VERIFIER_SHAPES[args.random_shape], Path(scratch), args.device, tokenizer=args.verifier,
                                       name=f"random-{args.random_shape}")
        results = measure(args, params, verifier, samples, tokenizer.pad_token_id or 0)  # as the stage pads
    results = {"device": args.device, "shape": args.random_shape or "verifier", "samples": len(samples), "tokens": tokens,
               "threads": args.threads, "batch_tokens": args.batch_tokens, **results}
    print(json.dumps(results, indent=2))


def measure(args, params, verifier: Path, samples, pad_id: int) -> dict:
    """Single-process throughput per storage dtype, then the optional worker scaling and dvc add timing."""
    tokens = sum(len(s.input_ids) for s in samples)
    model = load_verifier(verifier, args.device, args.compute_dtype)
    hidden = model.config.hidden_size
    results = {}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        settings = Settings("bench", tuple(params.model.aux_layers), dtype, 8192, args.batch_tokens, 256 << 20, args.device,
                            args.compute_dtype, 1, args.threads, WHOLE_COPY)
        time_extraction(model, samples[:1], settings, pad_id)  # warm-up: first-call kernel setup
        runs = [time_extraction(model, samples, settings, pad_id) for _ in range(args.runs)]
        results[dtype] = {
            "tokens_per_s": round(tokens / statistics.median(s for s, _ in runs), 1),
            "bytes_per_token": round(runs[0][1] / tokens, 1),
            "estimated_bytes_per_token": bytes_per_token(hidden, len(params.model.aux_layers), dtype),
        }
    results["forward_only_tokens_per_s"] = round(tokens / statistics.median(time_forward(model, samples, settings, pad_id) for _ in range(args.runs)), 1)
    del model  # the workers load their own
    if args.workers:
        results["workers"] = time_workers(verifier, samples, dataclasses.replace(settings, dtype="bfloat16"), args.workers, pad_id)
    if args.dvc_gb > 0:
        seconds = [dvc_add_seconds(args.dvc_gb, 256 << 20) for _ in range(args.runs)]
        results["dvc_add_s_per_gb"] = round(statistics.median(seconds), 2)
    return results


if __name__ == "__main__":
    main()
