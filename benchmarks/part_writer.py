"""extract's part writer against the one it replaced, on the host alone: the wall time of a part, and how much of
the interpreter it leaves to the thread that runs the verifier meanwhile; then the stream of every part through
``PartWriter`` with one writer thread and with ``PART_WRITERS`` (``threads``: MB/s, each the median of the repeats).

    python benchmarks/part_writer.py benchmarks/results/part_writer_cpu.json
    python benchmarks/part_writer.py OUT.json --parts 2 --repeats 1 --smoke     # seconds (a small part)

Each part holds random samples of SmolLM2-135M's stored shape (bf16 ``aux`` [T, 3H] and ``final`` [T, H], H = 576,
T uniform in 50-450 tokens) up to ``--part-mib``. ``before``: ``torch.cat`` of every key, ``safetensors.torch.save_file``
and the file read back for its sha256 (extract's writer until this benchmark's commit); ``after``:
``eagle3.hidden_states.storage.write_part``. Both run in a background thread, as extract runs them, while the main
thread spins a pure-Python loop: ``interpreter_left`` is the loop's iterations a second during the write over its
iterations a second alone just before (1.0: the write never held the interpreter lock). Medians over ``--repeats``; the files'
bytes are compared (``same_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common import commit, environment

from eagle3.common import sha256_file
from eagle3.hidden_states.samples import Sample
from eagle3.hidden_states.storage import PART_WRITERS, PartWriter, write_part

HIDDEN = 576


def samples(part_mib: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    out, total = [], 0
    while total < part_mib << 20:
        tokens = int(torch.randint(50, 450, (1,), generator=generator))
        sample = {"input_ids": torch.randint(0, 49152, (tokens,), dtype=torch.int32, generator=generator),
                  "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                  "aux": torch.randn(tokens, 3 * HIDDEN, generator=generator).bfloat16(),
                  "final": torch.randn(tokens, HIDDEN, generator=generator).bfloat16()}
        out.append(sample)
        total += sum(t.nbytes for t in sample.values())
    return out


def before(path: Path, part: list[dict[str, torch.Tensor]]) -> str:
    save_file({key: torch.cat([stored[key] for stored in part]) for key in part[0]}, path)
    return sha256_file(path)


def spin(stop: threading.Event) -> int:
    count = 0
    while not stop.is_set():
        for _ in range(10_000):
            count += 1
    return count


def spin_rate(seconds: float) -> float:
    """The loop's iterations a second with no write beside it."""
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10_000):
            count += 1
    return count / seconds


def timed(write, path: Path, part: list) -> tuple[float, float, str]:
    """(wall seconds of the write, the spinning main thread's iterations a second meanwhile, the sha256)."""
    stop, result = threading.Event(), {}

    def background():
        start = time.perf_counter()
        result["sha256"] = write(path, part)
        result["seconds"] = time.perf_counter() - start
        stop.set()

    thread = threading.Thread(target=background)
    start = time.perf_counter()
    thread.start()
    count = spin(stop)
    rate = count / (time.perf_counter() - start)
    thread.join()
    return result["seconds"], rate, result["sha256"]


def streamed(writers: int):
    """A write (as ``timed`` takes one) that hands every part's samples to a PartWriter of ``writers`` threads
    writing into the folder, and waits for them all."""
    def write(folder: Path, parts: list[list[dict[str, torch.Tensor]]]) -> str:
        part_bytes = sum(t.nbytes for t in parts[0][0].values()) * len(parts[0])  # about a part of the generated ones
        with PartWriter(folder, part_bytes, writers) as writer:
            for record, sample in enumerate(sample for part in parts for sample in part):
                tokens = len(sample["input_ids"])
                writer.add(Sample(str(record), record, sample["input_ids"].tolist(), [1] * tokens, False), sample, {})
        return ""
    return write


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--part-mib", type=int, default=256, help="bytes of a part (extract.part_bytes), MiB")
    parser.add_argument("--parts", type=int, default=3, help="distinct parts written by each writer in turn")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="8 MiB parts")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    parts = [samples(8 if args.smoke else args.part_mib, generator) for _ in range(args.parts)]
    runs = {"before": [], "after": []}
    same = True
    with tempfile.TemporaryDirectory(dir=args.out.parent) as folder:
        for repeat in range(args.repeats):
            for i, part in enumerate(parts):
                digests = {}
                for name, write in (("before", before), ("after", write_part)):  # in turn: a varying load hits both
                    path = Path(folder) / f"{name}-{i}.safetensors"
                    alone = spin_rate(0.5)
                    seconds, rate, digests[name] = timed(write, path, part)
                    runs[name].append({"seconds": seconds, "interpreter_left": rate / alone})
                    path.unlink()
                same &= digests["before"] == digests["after"]
        threads = {str(writers): [] for writers in sorted({1, PART_WRITERS})}
        for repeat in range(args.repeats):
            for writers in threads:  # in turn, the main thread spinning meanwhile as before
                out = Path(folder) / f"threads-{writers}"
                out.mkdir()
                alone = spin_rate(0.5)
                seconds, rate, _ = timed(streamed(int(writers)), out, parts)
                threads[writers].append({"seconds": seconds, "interpreter_left": rate / alone})
                for path in out.iterdir():
                    path.unlink()
                out.rmdir()
    part_bytes = statistics.median(sum(t.nbytes for s in part for t in s.values()) for part in parts)
    figures = {name: {"seconds": statistics.median(r["seconds"] for r in rows),
                      "mb_per_s": part_bytes / 1e6 / statistics.median(r["seconds"] for r in rows),
                      "interpreter_left": statistics.median(r["interpreter_left"] for r in rows), "runs": rows}
               for name, rows in runs.items()}
    total = sum(t.nbytes for part in parts for s in part for t in s.values())
    figures["threads"] = {writers: {"mb_per_s": total / 1e6 / statistics.median(r["seconds"] for r in rows),
                                    "interpreter_left": statistics.median(r["interpreter_left"] for r in rows), "runs": rows}
                          for writers, rows in threads.items()}
    record = {"commit": commit(), "command": " ".join(["python", *sys.argv]), "environment": environment("cpu"),
              "part_bytes": part_bytes, "same_bytes": same, "figures": figures}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for name in ("before", "after"):
        row = figures[name]
        print(f"{name}: {row['seconds']:.3f} s a part ({row['mb_per_s']:.0f} MB/s), interpreter left {row['interpreter_left']:.2f}")
    for writers, row in figures["threads"].items():
        print(f"{len(parts)} parts through PartWriter, {writers} writer thread(s): {row['mb_per_s']:.0f} MB/s, "
              f"interpreter left {row['interpreter_left']:.2f}")
    print(f"same bytes: {same}")


if __name__ == "__main__":
    main()
