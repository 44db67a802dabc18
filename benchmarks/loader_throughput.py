"""Benchmark of the ``train`` stage's input side alone: packed rows a second from hidden-state shards, no model.

    python benchmarks/loader_throughput.py --smoke                     # a tiny shape, a few rows: seconds (tests run it)
    python benchmarks/loader_throughput.py --out /tmp/loader.json      # the 10k shape: 2,000 samples, 8,192-token rows
    python benchmarks/loader_throughput.py --workers 4 --rows 256 --samples 8000 --profile 0

Writes a set of hidden states in the stage's own format (``storage.PartWriter`` parts of random bf16 states
of the ``--preset`` verifier's shape, their index.jsonl and meta.json, a merged manifest in seeded-shuffle
order as merge writes it: prompts of ``--prompt`` tokens and answers of ``--answer`` tokens on average, lengths
uniform in [n/2, 3n/2]), then reads its train split as the stage does: ``HiddenStates`` items, packed and
collated by ``collate_ttt`` in the order of ``DataPlan``, through the stage's ``step_batches`` DataLoader at
each ``--workers`` count (pinned memory where CUDA is there; the parts page-cached first), and times ``--rows`` micro-batches after the
first (the workers' start is reported apart). Then the training process's work on one collated batch: the
pin-memory thread's copy (on a GPU) and ``to_device`` (to the GPU where there is one) and, with ``--profile N``, the cProfile of N rows read and
collated in one process, as a worker does it.

Writes JSON to ``--out``: {"commit", "command", "figures": {"shape", "cpus", "rows_per_s": {workers: rows/s},
"first_row_s": {workers: s}, "pin_ms" (on a GPU), "to_device_ms", "profile"}}. Needs no GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.data._utils.pin_memory import pin_memory

from common import commit
from eagle3.common import write_json, write_jsonl
from eagle3.hidden_states.loader import HiddenStates
from eagle3.hidden_states.samples import Sample
from eagle3.hidden_states.capture import stored_samples
from eagle3.hidden_states.storage import PartWriter
from eagle3.training.config import Batching
from eagle3.training.data import DataPlan, step_batches
from eagle3.training.step import collate_ttt, to_device
from shapes import DRAFTER_SHAPES

SMOKE_SHAPE = dict(hidden_size=64, vocab_size=512, aux_layers=(0, 1, 2))
SHARD = "000000-bench"
FINGERPRINT = "loader-benchmark"


def random_lengths(count: int, mean: int, generator: torch.Generator) -> list[int]:
    return torch.randint(max(1, mean // 2), mean * 3 // 2 + 1, (count,), generator=generator).tolist()


def write_hidden_states(root: Path, shape: dict, samples: int, prompt: int, answer: int, part_bytes: int) -> None:
    """``root``/hidden/<shard> and ``root``/merged in the stage's format: random states, 10 % of the samples in val."""
    generator = torch.Generator().manual_seed(0)
    hidden, width = shape["hidden_size"], shape["hidden_size"] * len(shape["aux_layers"])
    folder = root / "hidden" / SHARD
    folder.mkdir(parents=True)
    with PartWriter(folder, part_bytes) as writer:
        for i, (p, a) in enumerate(zip(random_lengths(samples, prompt, generator), random_lengths(samples, answer, generator))):
            ids = torch.randint(0, shape["vocab_size"], (p + a,), generator=generator)
            mask = [0] * p + [1] * a
            aux, final = torch.randn(1, p + a, width, generator=generator), torch.randn(1, p + a, hidden, generator=generator)
            writer.add(*next(stored_samples([Sample(f"s{i}", i, ids.tolist(), mask, False)], ids[None], aux, final, "bfloat16")))
    write_jsonl(folder / "index.jsonl", writer.index)
    write_json(folder / "meta.json", {"verifier": {"fingerprint": FINGERPRINT}})
    order = torch.randperm(samples, generator=generator).tolist()
    val = set(order[: samples // 10])
    rows = [{"shard": SHARD, "index": i, **{key: writer.index[i][key] for key in ("id", "part", "offset", "length", "masked")},
             "split": "val" if i in val else "train"} for i in order]
    (root / "merged").mkdir()
    write_jsonl(root / "merged" / "manifest.jsonl", rows)
    write_json(root / "merged" / "meta.json", {"verifier": {"fingerprint": FINGERPRINT}, "hidden_size": hidden,
                                               "aux_layers": list(shape["aux_layers"]), "vocab_size": shape["vocab_size"]})


def rows_per_second(dataset: HiddenStates, plan: DataPlan, collate_fn, workers: int, rows: int, pin: bool) -> tuple[float, float]:
    """(rows/s over ``rows`` micro-batches after the first, seconds to the first) through the stage's DataLoader."""
    start = time.perf_counter()
    batches = iter(step_batches(dataset, plan, range(rows + 1), collate_fn, workers, pin))
    next(batches)
    first = time.perf_counter()
    for _ in range(rows):
        next(batches)
    return rows / (time.perf_counter() - first), first - start


def main_process_ms(batch: dict, device: torch.device, repeats: int) -> dict[str, float]:
    """Median ms of the training process's work on one collated batch: the pin-memory thread's copy into page-locked
    memory (a GPU only; ``pin_memory`` of the DataLoader) and ``to_device``, waiting for the copy to finish."""
    def median_ms(work) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    figures = {}
    if device.type == "cuda":
        figures["pin_ms"] = median_ms(lambda: pin_memory(batch, device))
        batch = pin_memory(batch, device)
    figures["to_device_ms"] = median_ms(lambda: to_device(batch, device))
    return figures


def profile_rows(dataset: HiddenStates, plan: DataPlan, collate_fn, rows: int) -> str:
    """cProfile of ``rows`` micro-batches read and collated in this process (a worker's work), top 20 by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    for step in range(rows):
        for micro in plan.micro_batches(step):
            collate_fn([dataset[i] for i in micro])
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(20)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m", choices=sorted(DRAFTER_SHAPES))
    parser.add_argument("--samples", type=int, default=2000, help="samples written (train: 90 %%)")
    parser.add_argument("--prompt", type=int, default=170, help="mean prompt tokens")
    parser.add_argument("--answer", type=int, default=128, help="mean answer tokens")
    parser.add_argument("--pack-tokens", type=int, default=8192, help="tokens of a packed row (the 10k recipe's)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="TTT steps selected (the 10k recipe's)")
    parser.add_argument("--part-bytes", type=int, default=256 << 20, help="bytes of a part (extract.part_bytes' default)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 4], help="DataLoader worker counts timed")
    parser.add_argument("--rows", type=int, default=48, help="micro-batches timed at each worker count")
    parser.add_argument("--profile", type=int, default=8, help="rows profiled in one process (0: none)")
    parser.add_argument("--workdir", help="parent of the temporary folder (default: system temp)")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, 64 samples, rows of 512 tokens, workers 0 1")
    args = parser.parse_args()
    shape = {key: DRAFTER_SHAPES[args.preset][key] for key in SMOKE_SHAPE}
    if args.smoke:
        shape, args.samples, args.pack_tokens, args.workers, args.rows, args.profile = SMOKE_SHAPE, 64, 512, [0, 1], 4, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batching = Batching(pack_tokens=args.pack_tokens, batch_size=1, grad_accum=1)
    collate_fn = partial(collate_ttt, batching=batching, ttt_steps=args.ttt_steps)
    with tempfile.TemporaryDirectory(prefix="eagle3-loader-bench-", dir=args.workdir) as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        write_hidden_states(root, shape, args.samples, args.prompt, args.answer, args.part_bytes)
        os.sync()  # the parts written back and then read once: page-cached, as the stage finds them after extract
        for part in sorted((root / "hidden" / SHARD).glob("*.safetensors")):
            part.read_bytes()
        dataset = HiddenStates(root / "merged", root / "hidden", "train")
        plan = DataPlan(dataset.lengths, batching, seed=0)
        print(f"wrote {len(dataset)} train samples, {sum(dataset.lengths)} tokens, {plan.steps_in(0)} rows of {args.pack_tokens} "
              f"an epoch in {time.perf_counter() - start:.1f} s ({os.cpu_count()} CPUs, device {device})")
        rates, firsts = {}, {}
        for workers in args.workers:
            rates[workers], firsts[workers] = rows_per_second(dataset, plan, collate_fn, workers, args.rows, device.type == "cuda")
            print(f"  workers {workers}: {rates[workers]:7.1f} rows/s ({rates[workers] * args.pack_tokens / 1e6:.2f}M tokens/s), "
                  f"first row after {firsts[workers]:.2f} s")
        batch = collate_fn([dataset[i] for i in plan.micro_batches(0)[0]])
        moved = main_process_ms(batch, device, repeats=5)
        print(f"  the training process, a row ({device}): " + ", ".join(f"{name} {ms:.2f}" for name, ms in moved.items()))
        profile = profile_rows(dataset, plan, collate_fn, args.profile) if args.profile else ""
        print(profile)
    figures = {"shape": {**shape, "samples": args.samples, "pack_tokens": args.pack_tokens, "ttt_steps": args.ttt_steps},
               "cpus": os.cpu_count(), "device": str(device), "rows_per_s": rates, "first_row_s": firsts, **moved,
               "profile": profile}
    if args.out:
        Path(args.out).write_text(json.dumps({"commit": commit(), "command": f"python {' '.join(sys.argv)}",
                                              "figures": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
