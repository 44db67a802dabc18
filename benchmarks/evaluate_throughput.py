"""Benchmark of the ``evaluate`` stage: wall time and tokens/s of plain, chain and tree decoding.

    python benchmarks/evaluate_throughput.py models/verifier --drafter models/drafter \\
        --prompts data/prompts/eval/heldout.jsonl --run 6:6 --run 1:6             # CPU, the demo's shapes
    python benchmarks/evaluate_throughput.py models/verifier --device cuda --dtype bfloat16 \\
        --prompts data/prompts/eval/heldout.jsonl --run 96:96 --run 1:8            # one H200, the 1k run's 96

Each ``--run B:N`` decodes the first N prompts B at a time with ``eagle3.evaluate.decode_all`` (the
stage's own loop: plain greedy, chain of ``--draft-tokens``, SGLang's tree) after an untimed
warm-up of every method on the first batch, and prints one JSON line per method: prompts, batch
size, generated tokens, decoding seconds (each batch's prefill is shared and not counted), tokens/s,
τ, and the wall seconds of the whole run, prefills included. ``--run 1:N`` is prompt-by-prompt decoding (what
the stage did before batching). Without ``--drafter`` a random drafter of the verifier's shape
(τ ≈ 1: the most verifier forwards, the slowest case); without ``--prompts``, random token prompts
of ``--prompt-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from eagle3.common import read_jsonl
from eagle3.drafter.export import load_drafter
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.drafter.speculative import TreeShape
from eagle3.evaluate import WARMUP_TOKENS, Settings, decode_all
from eagle3.verifiers.chat import prompt_ids
from eagle3.verifiers.loading import eos_token_ids, load_tokenizer, load_verifier


def random_drafter(verifier_dir: Path, embed: torch.Tensor, taps: list[int]) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DraftConfig.from_verifier(AutoConfig.from_pretrained(verifier_dir), min(32000, embed.shape[0]), taps)
    drafter = Eagle3Drafter(cfg, embed)
    drafter.set_draft_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # the first Vd tokens
    return drafter


def load_prompts(args, tokenizer, vocab_size: int) -> list[torch.Tensor]:
    count = max(int(run.split(":")[1]) for run in args.run)
    if args.prompts:
        records = list(read_jsonl(args.prompts))[:count]
        return [torch.tensor(prompt_ids(tokenizer, r["messages"]), device=args.device) for r in records]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (args.prompt_tokens,), generator=g).to(args.device) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path)
    parser.add_argument("--drafter", type=Path, help="exported drafter folder (default: random, verifier-shaped)")
    parser.add_argument("--taps", type=int, nargs=3, help="random drafter's taps (default: 2, L//2, L-3)")
    parser.add_argument("--prompts", type=Path, help="eval set jsonl (default: random token prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--run", action="append", default=None, help="B:N, N prompts B at a time (repeatable; default 6:6)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=7)
    parser.add_argument("--tree", type=int, nargs=3, default=[5, 4, 16], metavar=("STEPS", "TOPK", "TOKENS"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.run = args.run or ["6:6"]
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the stage does: a setup per new key length

    verifier = load_verifier(args.verifier, args.device, args.dtype)
    tokenizer = load_tokenizer(args.verifier)
    embed = verifier.get_input_embeddings().weight
    layers = verifier.config.get_text_config().num_hidden_layers
    if args.drafter:
        drafter = load_drafter(args.drafter, embed)
    else:
        drafter = random_drafter(args.verifier, embed, args.taps or [2, layers // 2, layers - 3])
    drafter = drafter.to(args.device, embed.dtype).eval()
    eos = eos_token_ids(verifier, tokenizer)
    prompts = load_prompts(args, tokenizer, embed.shape[0])
    for run in args.run:
        batch_size, count = map(int, run.split(":"))
        settings = Settings(args.draft_tokens, TreeShape(*args.tree), batch_size, args.max_new_tokens, ("bench",), count,
                            False, args.device, args.dtype, args.threads, False)
        decode_all(verifier, drafter, prompts[:batch_size], settings, eos, WARMUP_TOKENS)
        start = time.perf_counter()
        runs = decode_all(verifier, drafter, prompts[:count], settings, eos)
        wall = time.perf_counter() - start
        for name, result in runs.items():
            tokens = sum(map(len, result.outputs))
            tau = 1 + sum(result.accepted) / max(1, len(result.accepted)) if name != "plain" else 1.0
            print(json.dumps({"method": name, "batch_size": batch_size, "prompts": count, "tokens": tokens,
                              "seconds": round(result.seconds, 2), "tokens_per_s": round(tokens / result.seconds, 1),
                              "tau": round(tau, 3), "wall_seconds_all_methods": round(wall, 2)}), flush=True)


if __name__ == "__main__":
    main()
