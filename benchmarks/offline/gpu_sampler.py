"""The GPUs' utilisation and memory every ``--every`` seconds, through NVML, appended to a TSV file until the
process is ended: ``t`` (unix seconds), ``util`` (percent of the interval a kernel ran, the mean over the
GPUs), ``mem_mib`` (used, summed over the GPUs). The first line names the GPUs (``# gpu: NAME xN``). Where NVML
is missing (a CPU machine) it writes ``# no NVML: <why>`` and exits 0: benchmarks/pipeline_report.py then
reports no GPU busy share.

    python3 benchmarks/offline/gpu_sampler.py RUN/logs/gpu.tsv --every 0.2 &

The one NVML reader of the benchmarks: ``benchmarks/train_throughput.py`` samples its own GPU with
``open_gpus`` and ``samples`` in a thread. Standalone (the standard library and ``pynvml`` only):
``benchmarks/offline/pipeline_run.sh`` copies this file alone into a run folder.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Iterator
from pathlib import Path


def open_gpus(indices: list[int] | None = None) -> tuple[object, list]:
    """NVML (``pynvml``, of nvidia-ml-py: GPU hosts only) and the handles of the GPUs ``indices`` (default: all).
    Raises where NVML or a GPU is missing."""
    import pynvml

    pynvml.nvmlInit()
    indices = range(pynvml.nvmlDeviceGetCount()) if indices is None else indices
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
    if not handles:
        raise RuntimeError("no GPU")
    return pynvml, handles


def samples(nvml, handles: list, every: float, stop: threading.Event) -> Iterator[tuple[float, float, float]]:
    """(unix seconds, utilisation % as the mean over ``handles``, used MiB summed) every ``every`` s until ``stop`` is set."""
    while not stop.is_set():
        util = sum(nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles) / len(handles)
        mem = sum(nvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) / 2**20
        yield time.time(), util, mem
        stop.wait(every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    args = parser.parse_args()
    with args.out.open("a", encoding="utf-8") as out:
        try:
            nvml, handles = open_gpus()
        except Exception as error:  # noqa: BLE001 - any failure means the same: nothing to sample here
            out.write(f"# no NVML: {type(error).__name__}: {error}\n")
            return
        names = sorted({nvml.nvmlDeviceGetName(h) for h in handles})
        out.write(f"# gpu: {' + '.join(names)} x{len(handles)}\nt\tutil\tmem_mib\n")
        out.flush()
        for t, util, mem in samples(nvml, handles, args.every, threading.Event()):  # until the process is ended
            out.write(f"{t:.3f}\t{util:.1f}\t{mem:.0f}\n")
            out.flush()


if __name__ == "__main__":
    main()
