"""The GPUs' utilisation and memory every ``--every`` seconds, through NVML, appended to a TSV file until the
process is ended: ``t`` (unix seconds), ``util`` (percent of the interval a kernel ran, the mean over the
GPUs), ``mem_mib`` (used, summed over the GPUs). The first line names the GPUs (``# gpu: NAME xN``). Where NVML
is missing (a CPU machine) it writes ``# no NVML: <why>`` and exits 0: benchmarks/pipeline_report.py then
reports no GPU busy share.

    python3 benchmarks/offline/gpu_sampler.py RUN/logs/gpu.tsv --every 0.2 &
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    args = parser.parse_args()
    with args.out.open("a", encoding="utf-8") as out:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            if not handles:
                raise RuntimeError("no GPU")
        except Exception as error:  # noqa: BLE001 - any failure means the same: nothing to sample here
            out.write(f"# no NVML: {type(error).__name__}: {error}\n")
            return
        names = sorted({pynvml.nvmlDeviceGetName(h) for h in handles})
        out.write(f"# gpu: {' + '.join(names)} x{len(handles)}\nt\tutil\tmem_mib\n")
        out.flush()
        while True:
            util = sum(pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles) / len(handles)
            mem = sum(pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles) / 2**20
            out.write(f"{time.time():.3f}\t{util:.1f}\t{mem:.0f}\n")
            out.flush()
            time.sleep(args.every)


if __name__ == "__main__":
    main()
