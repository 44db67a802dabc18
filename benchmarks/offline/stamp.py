"""Each line of stdin appended to FILE after its arrival time (``<unix seconds>\\t<line>``), flushed at once,
so a log piped through it gives every line's time (benchmarks/pipeline_report.py reads DVC's stage lines).

    dvc repro 2>&1 | python3 -u benchmarks/offline/stamp.py RUN/logs/dvc.log
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    with open(sys.argv[1], "a", encoding="utf-8") as out:
        for line in sys.stdin:
            now = time.time()
            for part in line.split("\r"):  # a progress bar's updates: a line each
                if part.strip():
                    out.write(f"{now:.3f}\t{part.rstrip()}\n")
            out.flush()


if __name__ == "__main__":
    main()
