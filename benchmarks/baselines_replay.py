"""evaluate's baselines replay (most frequent token, prompt lookup) on one set's worth of synthetic answers: the
prompt lookup it ships against a Python scan of every earlier position (the one before it), the same reports.

    python benchmarks/baselines_replay.py benchmarks/results/baselines_replay_cpu.json
    python benchmarks/baselines_replay.py OUT.json --smoke      # 10 answers, once: seconds (tests/)

200 prompts of 40-400 random tokens (SmolLM2's vocabulary), each with a 256-token answer that half the time copies a
stretch of its own last 30 tokens (the loops that make prompt lookup pay), K = 7 as `evaluate` drafts. ``scan`` is
``baselines`` with the scanning ``ngram``; ``after`` with the shipped one. Medians over ``--repeats``, in turn.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from common import commit, environment

import eagle3.decoding.baselines as module


def scanned_ngram(history: list[int], k: int, max_n: int = 3) -> list[int]:
    for n in range(min(max_n, len(history) - 1), 0, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == history[-n:]:
                return history[start + n : start + n + k]
    return []


def answers(seed: int, count: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(count):
        prompts.append(torch.tensor([rng.randrange(49152) for _ in range(rng.randint(40, 400))]))
        out: list[int] = []
        while len(out) < 256:
            if len(out) > 2 and rng.random() < 0.5:
                start = rng.randrange(max(0, len(out) - 30), len(out) - 1)
                out += out[start : start + rng.randint(3, 12)]
            else:
                out += [rng.randrange(49152) for _ in range(rng.randint(1, 8))]
        outputs.append(out[:256])
    return prompts, outputs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="10 answers, one repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats = 1
    prompts, outputs = answers(0, 10 if args.smoke else 200)
    seconds, reports = {"scan": [], "after": []}, {}
    for _ in range(args.repeats):
        for name in seconds:
            with mock.patch.object(module, "ngram", scanned_ngram if name == "scan" else module.ngram):
                start = time.perf_counter()
                reports[name] = module.baselines(prompts, outputs, 7, (64, 256))
                seconds[name].append(time.perf_counter() - start)
    figures = {name: {"seconds": statistics.median(times), "runs": times} for name, times in seconds.items()}
    figures["speedup"] = figures["scan"]["seconds"] / figures["after"]["seconds"]
    record = {"commit": commit(), "command": " ".join(["python", *sys.argv]), "environment": environment("cpu"),
              "same_reports": reports["scan"] == reports["after"], "ngram_tau": reports["after"]["ngram"]["tau"], "figures": figures}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"scan {figures['scan']['seconds']:.2f} s, after {figures['after']['seconds']:.2f} s ({figures['speedup']:.1f}x); "
          f"same reports: {record['same_reports']}")


if __name__ == "__main__":
    main()
