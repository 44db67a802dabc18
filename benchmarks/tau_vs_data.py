"""τ against training data: a log-linear fit per eval set over pipeline runs that differ only in how many training
prompts the drafter saw (``-S merge.train_prompts=N``, the same recipe and epochs), and the prompts it would take to
reach a chain τ of RATIO × prompt lookup's, if τ keeps rising as it did.

    python benchmarks/tau_vs_data.py 1000=benchmarks/results/pipeline_10k_train_prompts1000.json \\
        3000=benchmarks/results/pipeline_10k_train_prompts3000.json 7999=benchmarks/results/pipeline_10k_42c77ec.json \\
        --out benchmarks/results/tau_vs_data_10k.json

Each ``N=FILE`` is a benchmarks/pipeline_report.py record (its ``sets``) of a drafter trained on N prompts. The fit
is least squares of chain τ on ln N; the target is RATIO (default 1.3) times prompt lookup's τ in the run with the
most prompts. An extrapolation, not a measurement: the JSON says so and keeps the points it came from.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def parse_point(text: str) -> tuple[int, Path]:
    prompts, _, file = text.partition("=")
    if not prompts.isdigit() or not file:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N=FILE (training prompts = a pipeline_report.py JSON)")
    return int(prompts), Path(file)


def set_fit(points: list[tuple[int, dict]], name: str, ratio: float) -> dict:
    """One eval set's fit over the points (prompts, that run's sets) and the prompts its target needs."""
    xs = [math.log(prompts) for prompts, _ in points]
    ys = [sets[name]["tau"] for _, sets in points]
    b, a = np.polyfit(xs, ys, 1)  # least squares τ = a + b·ln N
    most, largest = points[-1]
    target = ratio * largest[name]["ngram_tau"]
    needed = math.exp((target - a) / b) if b > 0 else None
    return {"chain_tau": ys, "tau_per_e_fold": round(b, 3), "residuals": [round(y - a - b * x, 3) for x, y in zip(xs, ys)],
            "target_tau": round(target, 3), "met": ys[-1] >= target,
            "prompts_needed": round(needed) if needed else None,
            "times_largest": round(needed / most, 2) if needed else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("points", nargs="+", type=parse_point, help="N=FILE: a pipeline_report.py JSON of a drafter trained on N prompts")
    parser.add_argument("--ratio", type=float, default=1.3, help="target chain τ over prompt lookup's (default 1.3)")
    parser.add_argument("--out", type=Path, help="write the fit here as JSON")
    args = parser.parse_args()
    counts = [prompts for prompts, _ in args.points]
    if len(set(counts)) != len(counts) or len(counts) < 2:
        parser.error("need runs at two or more prompt counts, each once")
    files = sorted(args.points, key=lambda point: point[0])
    records = [(prompts, json.loads(file.read_text())) for prompts, file in files]
    points = [(prompts, record["sets"]) for prompts, record in records]
    names = [name for name in points[-1][1] if all(name in sets for _, sets in points)]
    result = {
        "what": "an extrapolation: least squares of chain tau on ln(training prompts), fixed recipe and epochs",
        "ratio": args.ratio,
        "points": [{"train_prompts": prompts, "commit": record["commit"], "command": record["command"], "gpu": record["gpu"],
                    "file": str(file)} for (prompts, record), (_, file) in zip(records, files)],
        "sets": {name: set_fit(points, name, args.ratio) for name in names},
    }
    for name, fit in result["sets"].items():
        needed = f"{fit['prompts_needed']:,} prompts ({fit['times_largest']}x)" if fit["prompts_needed"] else "never (tau not rising)"
        print(f"{name}: chain tau {fit['chain_tau']}, +{fit['tau_per_e_fold']} per e-fold; "
              f"{fit['target_tau']} {'met' if fit['met'] else 'needs ' + needed}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
