"""Benchmark of the ``generate`` stage: generated tokens/s of a backend on real prompts.

    python benchmarks/generate_throughput.py models/verifier data/prompts/shards/000000-000032.jsonl \\
        --backend local --batch-size 16 --prompts 16 --max-new-tokens 64 --threads 1
    python benchmarks/generate_throughput.py models/verifier data/prompts/shards/000000-000032.jsonl \\
        --backend openai --base-url http://127.0.0.1:8000/v1 --concurrency 4

Runs ``eagle3.generate.generate_shard`` (the stage's core: plan, backend, journal) on the first
``--prompts`` prompts with params composed from conf/ and prints one JSON line: answers, generated
tokens, wall seconds of the generation (model loading excluded) and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from eagle3.backends import make_backend
from eagle3.config import compose_params
from eagle3.generate import Journal, generate_shard, generation_params, read_prompts
from eagle3.verifier import load_tokenizer, read_meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path)
    parser.add_argument("prompts", type=Path)
    parser.add_argument("--backend", choices=["local", "openai"], default="local")
    parser.add_argument("--prompts", dest="count", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="local backend")
    parser.add_argument("--threads", type=int, default=1, help="local backend: torch threads")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="openai backend")
    parser.add_argument("--concurrency", type=int, default=4, help="openai backend")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"backend={args.backend}", f"generate.max_new_tokens={args.max_new_tokens}"]
        if args.backend == "local":
            overrides += [f"backend.batch_size={args.batch_size}", f"layout.threads={args.threads}"]
        else:
            overrides += [f"backend.base_urls=[{args.base_url}]", f"backend.concurrency={args.concurrency}"]
        compose_params(overrides, output=Path(tmp) / "params.yaml")
        params = OmegaConf.load(Path(tmp) / "params.yaml")
        prompts = read_prompts(args.prompts)[: args.count]
        verifier = read_meta(args.verifier)["fingerprint"]["id"]
        backend = make_backend(params.backend, args.verifier, params.generate)
        tokenizer = load_tokenizer(args.verifier)
        generation = generation_params(params.generate, args.backend)
        start = time.monotonic()
        shard = generate_shard("bench", prompts, backend, tokenizer, params.generate, generation, verifier,
                               Journal(Path(tmp) / "journal.jsonl"))
        seconds = time.monotonic() - start
    tokens = shard.stats["completion_tokens"]
    print(json.dumps({
        "backend": args.backend, "batch_size": args.batch_size if args.backend == "local" else None,
        "concurrency": args.concurrency if args.backend == "openai" else None,
        "threads": args.threads if args.backend == "local" else None,
        "answers": shard.stats["answers"], "errors": shard.stats["errors"], "tokens": tokens,
        "finish_reasons": shard.stats["finish_reasons"], "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
    }))


if __name__ == "__main__":
    main()
