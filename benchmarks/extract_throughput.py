"""Benchmark of the ``extract`` stage: verifier throughput, stored bytes per token, DVC commit cost.

    python benchmarks/extract_throughput.py models/verifier            # or .eagle3/cache/smollm2-135m
    python benchmarks/extract_throughput.py models/verifier --runs 3 --samples 16 --tokens 512 --dvc-gb 1

Prints, as medians over ``--runs``:
- extraction tokens/s of ``eagle3.extract.extract_samples`` (render excluded; forward, encode,
  checks and safetensors writes included) for bf16 and fp8 storage;
- bytes per token actually written (parts only) next to ``bytes_per_token`` of the preflight;
- ``dvc add`` time per GB of hidden-state parts (hash + move to cache + link) in a temporary
  repository with ``cache.type hardlink``: the cost DVC adds when it commits extract's output.
"""

from __future__ import annotations

import argparse
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

from eagle3.extract import ChatFormat, Settings, bytes_per_token, extract_samples, prepare
from eagle3.verifier import load_tokenizer, load_verifier

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
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    params = OmegaConf.load("params.yaml")
    tokenizer = load_tokenizer(args.verifier)
    samples, _ = prepare(conversations(args.samples, args.tokens), tokenizer, ChatFormat.from_params(params.model, tokenizer), 8192)
    tokens = sum(len(s.input_ids) for s in samples)
    model = load_verifier(args.verifier, args.device, args.compute_dtype)
    hidden = model.config.hidden_size
    results = {"device": args.device, "samples": len(samples), "tokens": tokens, "threads": args.threads, "batch_tokens": args.batch_tokens}
    for dtype in ("bfloat16", "float8_e4m3fn"):
        settings = Settings(tuple(params.model.aux_layers), dtype, 8192, args.batch_tokens, 256 << 20, args.device, args.compute_dtype, 1, args.threads)
        time_extraction(model, samples[:1], settings, tokenizer.pad_token_id)  # warm-up: first-call kernel setup
        runs = [time_extraction(model, samples, settings, tokenizer.pad_token_id) for _ in range(args.runs)]
        results[dtype] = {
            "tokens_per_s": round(tokens / statistics.median(s for s, _ in runs), 1),
            "bytes_per_token": round(runs[0][1] / tokens, 1),
            "estimated_bytes_per_token": bytes_per_token(hidden, len(params.model.aux_layers), dtype),
        }
    if args.dvc_gb > 0:
        seconds = [dvc_add_seconds(args.dvc_gb, 256 << 20) for _ in range(args.runs)]
        results["dvc_add_s_per_gb"] = round(statistics.median(seconds), 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
