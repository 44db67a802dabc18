"""Benchmark of ``evaluate``'s decoding: wall time and tokens/s of plain, chain and tree decoding per batch size.

    # one H200, a random SmolLM2-shaped verifier and drafter: does batching alone meet the 60 s target?
    python benchmarks/evaluate_throughput.py --shape smollm2 --device cuda --dtype bfloat16 \\
        --run 1:8 --run 32:96 --run 96:96
    python benchmarks/evaluate_throughput.py --device cpu --tiny       # a tiny shape in seconds (tested)
    python benchmarks/evaluate_throughput.py --verifier models/verifier --drafter models/drafter \\
        --prompts data/prompts/eval/heldout.jsonl --run 2:2             # a real verifier, drafter and eval set

Each ``--run B:N`` decodes the first N prompts B at a time with ``eagle3.evaluate.decode_all`` (the
stage's own loop: per batch one untimed prefill, then plain greedy, a chain of ``--draft-tokens``
and SGLang's tree, each timed) after the stage's untimed warm-up (``warm_up``), and
prints one row per method: decoding seconds and tokens/s (prefills not counted), τ, and the wall
seconds of the whole run (all methods and prefills: what ``evaluate`` spends on one eval set of N
prompts at ``evaluate.batch_size`` B). The rows end as a markdown table.

``--shape smollm2`` is SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocabulary 49152,
tied embedding) with random weights; its random drafter accepts almost nothing (τ ≈ 1: the most
verifier forwards, the slowest case), and random weights never emit EOS, so every prompt decodes
``--max-new-tokens`` tokens. Random prompts of ``--prompt-tokens`` tokens at most (half to all of
it, so batches are padded as real ones are).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.common import read_jsonl
from eagle3.drafter.export import load_drafter
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.drafter.speculative import TreeShape
from eagle3.evaluate import Settings, configure_torch, decode_all, for_decoding, warm_up
from eagle3.verifiers.chat import prompt_ids
from eagle3.verifiers.loading import WHOLE_COPY, eos_token_ids, input_embedding, load_tokenizer, load_verifier

# Random verifiers (Llama architecture): SmolLM2-135M's shape, and a tiny one for the CPU test.
SHAPES = {
    "smollm2": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512, rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=True),
}


def random_verifier(shape: str, device: str, dtype: str):
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape]))
    return model.to(getattr(torch, dtype)).eval()


def random_drafter(config, embed: torch.Tensor, taps: list[int]) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DraftConfig.from_verifier(config, min(32000, embed.shape[0]), taps)
    drafter = Eagle3Drafter(cfg, embed)
    drafter.set_draft_vocab(torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # the first Vd tokens
    return drafter


def load_prompts(args, tokenizer, vocab_size: int, count: int) -> list[torch.Tensor]:
    if args.prompts:
        records = list(read_jsonl(args.prompts))[:count]
        return [torch.tensor(prompt_ids(tokenizer, r["messages"]), device=args.device) for r in records]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (count,), generator=g)
    return [torch.randint(0, vocab_size, (int(n),), generator=g).to(args.device) for n in lengths]


def models(args):
    """(verifier, drafter, eos ids, tokenizer or None)."""
    if args.verifier:
        verifier = load_verifier(args.verifier, args.device, args.dtype)
        tokenizer = load_tokenizer(args.verifier)
        eos = eos_token_ids(verifier, tokenizer)
    else:
        verifier, tokenizer, eos = random_verifier(args.shape, args.device, args.dtype), None, set()
    embed = input_embedding(verifier)
    layers = verifier.config.get_text_config().num_hidden_layers
    if args.drafter:
        drafter = load_drafter(args.drafter, embed)
    else:
        drafter = random_drafter(verifier.config.get_text_config(), embed, args.taps or [1, layers // 2, layers - 1])
    return verifier, drafter.to(args.device, embed.dtype).eval(), eos, tokenizer


def measure(verifier, drafter, prompts, settings: Settings, eos: set[int]) -> list[dict]:
    """One row per method for these prompts decoded settings.batch_size at a time."""
    warm_up(verifier, drafter, prompts, settings, eos)
    start = time.perf_counter()
    runs = decode_all(verifier, drafter, prompts, settings, eos)
    wall = time.perf_counter() - start
    rows = []
    for name, run in runs.items():
        tokens = sum(map(len, run.outputs))
        rows.append({"batch_size": settings.batch_size, "prompts": len(prompts), "method": name, "tokens": tokens,
                     "seconds": round(run.seconds, 2), "tokens_per_s": round(tokens / run.seconds, 1),
                     "tau": round(1 + sum(run.accepted) / max(1, len(run.accepted)), 3),
                     "wall_seconds_all_methods": round(wall, 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, help="a verifier folder (default: a random one of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny, --run 1:2 --run 4:4, 8 new tokens")
    parser.add_argument("--drafter", type=Path, help="exported drafter folder (default: random, verifier-shaped)")
    parser.add_argument("--taps", type=int, nargs=3, help="random drafter's taps (default: 1, L//2, L-1)")
    parser.add_argument("--prompts", type=Path, help="eval set jsonl (default: random token prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--run", action="append", default=None, help="B:N, N prompts B at a time (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=7)
    parser.add_argument("--tree", type=int, nargs=3, default=[5, 4, 16], metavar=("STEPS", "TOPK", "TOKENS"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.tiny:
        args.shape, args.run, args.max_new_tokens, args.prompt_tokens = "tiny", args.run or ["1:2", "4:4"], 8, 24
    args.run = [tuple(map(int, run.split(":"))) for run in args.run or ["1:8", "32:96", "96:96"]]

    settings = Settings(args.draft_tokens, TreeShape(*args.tree), 1, args.max_new_tokens, ("bench",), None, False,
                        args.device, args.dtype, args.threads, False, WHOLE_COPY)
    configure_torch(settings)
    verifier, drafter, eos, tokenizer = models(args)
    for_decoding(verifier, drafter, settings)
    prompts = load_prompts(args, tokenizer, input_embedding(verifier).shape[0], max(count for _, count in args.run))
    print(f"# {args.verifier or args.shape} on {args.device} {args.dtype}, {torch.__version__}, "
          f"{args.max_new_tokens} new tokens, chain {args.draft_tokens}, tree {args.tree}", flush=True)
    rows = []
    for batch_size, count in args.run:
        for row in measure(verifier, drafter, prompts[:count], dataclasses.replace(settings, batch_size=batch_size), eos):
            print(json.dumps(row), flush=True)
            rows.append(row)
    columns = list(rows[0])
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
