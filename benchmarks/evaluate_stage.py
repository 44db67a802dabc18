"""Wall time and CPU seconds of the whole ``evaluate`` stage, as ``dvc repro`` runs it, on a finished demo.

    python benchmarks/evaluate_stage.py /path/to/demo --repeat 3                    # this checkout's src/
    python benchmarks/evaluate_stage.py /path/to/demo --src /other/checkout/src     # e.g. before a change

``/path/to/demo`` holds what the stage reads (``models/verifier``, ``models/drafter``,
``data/prompts``, ``params.yaml``: a demo after ``dvc repro``, or a copy of those). Each repeat runs
dvc.yaml's command, ``python -m eagle3.evaluate ...``, in a fresh interpreter with ``--src`` first
on PYTHONPATH, writing to a temporary folder, and prints one JSON line: wall seconds, CPU seconds
(user + system, of the process and its threads) and the stage's own per-set decoding seconds; a
last line gives the medians. Run several repeats, alternating checkouts, on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_stage(demo: Path, src: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "evaluate"
        cmd = [sys.executable, "-m", "eagle3.evaluate", "models/verifier", "models/drafter", "data/prompts", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        process = subprocess.Popen(cmd, cwd=demo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, stderr = process.communicate()
        wall = time.perf_counter() - start
        if process.returncode:
            raise SystemExit(f"evaluate failed:\n{stderr[-2000:]}")
        metrics = json.loads((out / "metrics.json").read_text())
    return {"wall_s": round(wall, 1), "sets_s": {name: m["seconds"] for name, m in metrics.items() if isinstance(m, dict)},
            "tau": {name: [m["tau"], m.get("tree", {}).get("tau")] for name, m in metrics.items() if isinstance(m, dict)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("demo", type=Path)
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the eagle3 sources to time (default: this checkout's)")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeat):
        before = os.times()
        row = run_stage(args.demo.resolve(), args.src.resolve())
        after = os.times()
        row["cpu_s"] = round(after.children_user + after.children_system - before.children_user - before.children_system, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"src": str(args.src), "repeats": len(rows), "median_wall_s": statistics.median(r["wall_s"] for r in rows),
                      "median_cpu_s": statistics.median(r["cpu_s"] for r in rows)}))


if __name__ == "__main__":
    main()
