"""Milliseconds of one decode-step attention call of the slot decoder (backends/slots.py), one layer, by
its kernel: ``split`` (Triton: each row's used keys split across programs, a kv head's query heads
together; the default where it runs), ``varlen`` (flash attention's varlen kernel over each row's used
keys: ``flash``) and ``masked`` (SDPA over the whole row, masked). SmolLM2's heads (9 over 3 kv heads,
64 wide), bf16.

    python benchmarks/decode_attention.py --json benchmarks/results/decode_attention.json   # CUDA, < 20 s
    python benchmarks/decode_attention.py --smoke        # the CPU (each kernel's fallback), a tiny cache: seconds

Per shape: rows x cache length with every row's used keys at half the length, uniform in [1, length] or
300; each time the median of 5 timings of 50 calls (CUDA events) and the 5's spread over the median;
the largest difference of each output from ``varlen``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from common import gpu_name  # first: this checkout's eagle3, installed or not
from eagle3.backends.slot_kernels import split_attention, varlen_attention, whole_row_attention

HEADS, KV_HEADS, DIM = 9, 3, 64


def milliseconds(call, device: str, reps: int = 50) -> tuple[float, float]:
    """(median, spread over the median) of 5 timings of ``reps`` calls, after one untimed (CUDA events; the
    host's clock on the CPU)."""
    call()
    cuda = device.startswith("cuda")
    clock = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else time.perf_counter
    times = []
    for _ in range(5):
        start = clock()
        if cuda:
            torch.cuda.synchronize()
            start.record()
        for _ in range(reps):
            call()
        end = clock()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps if cuda else (end - start) * 1000 / reps)
    times.sort()
    return round(times[2], 4), round((times[-1] - times[0]) / times[2], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--length", type=int, default=2304, help="cache positions a row (256-token prompts + 2,048 new)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", default="cuda", help="off CUDA each kernel runs its fallback (masked SDPA)")
    parser.add_argument("--reps", type=int, default=50, help="calls per timing")
    parser.add_argument("--smoke", action="store_true", help="the CPU, 4 rows of 64 positions, 2 calls a timing: seconds "
                        "(tests/test_benchmarks.py runs it)")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.rows, args.length, args.reps = "cpu", [4], 64, 2
    device = args.device
    generator = torch.Generator(device=device).manual_seed(0)
    scale, found = DIM ** -0.5, {}
    for n in args.rows:
        query = torch.randn(n, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=generator)
        keys = torch.randn(n, args.length, KV_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=generator)
        values = torch.randn_like(keys)
        keys_by_head, values_by_head = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
        for name, used in (("half", torch.full((n,), args.length // 2, device=device)),
                           ("uniform", torch.randint(1, args.length + 1, (n,), device=device, generator=generator)),
                           ("short", torch.full((n,), min(300, args.length), device=device))):
            mask = (torch.arange(args.length, device=device)[None] < used[:, None])[:, None, None, :]
            used = used.to(torch.int32)
            starts = torch.arange(n + 1, dtype=torch.int32, device=device)
            calls = {"varlen": lambda: varlen_attention(query, keys, values, used, scale, (starts, starts * args.length)),
                     "split": lambda: split_attention(query, keys, values, used, scale),
                     "masked": lambda: whole_row_attention(query, keys_by_head, values_by_head, mask, scale)}
            reference = calls["varlen"]().float()
            row = {}
            for method, call in calls.items():
                row[f"{method}_ms"], row[f"{method}_spread"] = milliseconds(call, device, args.reps)
                row[f"{method}_max_diff"] = (call().float() - reference).abs().max().item()
            found[f"{n}x{args.length}-{name}"] = row
            print(f"{n}x{args.length}-{name}", json.dumps(row), flush=True)
    if args.json:
        report = {"command": " ".join(sys.argv), "gpu": gpu_name(device), "torch": torch.__version__, "shapes": found}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
