"""Stage ``summary``: a run's headline numbers in one small metrics file.

    python -m eagle3.summary dvclive/train/metrics.json metrics/merge/metrics.json \\
        dvclive/evaluate/metrics.json metrics/summary.json --tau-vs-data metrics/tau_vs_data

Why: ``dvc exp show`` makes a column of every key of every declared metrics file. The stages'
own statistics (every TTT step's loss and accuracy, generation and merge counts, timings) run to
a couple of hundred keys, so they stay in their files, and this is the pipeline's only DVC
metric: what runs are compared by.

``metrics/summary.json``:

- per eval set: ``tau`` of the drafter's chain and ``<method>_tau`` of every method reported
  beside it: ``tree`` drafting, the ``baseline`` (most frequent token) and ``ngram`` (prompt
  lookup), and of a multi-turn set's turns (``turn1_tau``, ``turn2_tau``: the chain's);
  ``tau_by_position`` and ``tree_tau_by_position`` (τ per answer-position bucket, e.g. ``"0-64"``);
  where evaluate timed with repeats, ``speedup`` and ``speedup_spread`` (and the tree's) at its
  first batch size, and ``unstable`` (1: repeats disagreed by more than 10%); ``outside_draft_vocab`` (the share
  of the answers' tokens outside the draft vocabulary);
- ``val``: ``acc_0`` and ``sim_accept_len`` of the best validation (the exported weights);
- ``tokens_trained`` (padding excluded), ``steps`` (optimizer steps), ``samples`` (training
  samples), ``answer_tokens_mean`` (loss-masked tokens per sample) and ``hidden_state_bytes``.

``--tau-vs-data``: one file per eval set, one row: the training tokens and the τ of the drafter's
chain and tree and of prompt lookup. Every experiment contributes its point, so ``dvc plots diff``
(and ``eagle3 report``) over experiments of other scales or answer lengths draw τ against the
data it took.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.summary")

import argparse
from pathlib import Path
from typing import Any

from eagle3.common import UserError, atomic_dir, read_json, write_json
from eagle3.decoding.report import DIGITS, eval_set_headline, has_tau

PARAMS = ()  # = dvc.yaml: it reads only the three metrics files


def headline(train: dict[str, Any], merge: dict[str, Any], evaluate: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run from the three stages' metrics files (their parsed JSON)."""
    best = train["best"]
    return {
        **{name: eval_set_headline(report) for name, report in evaluate.items() if has_tau(report)},
        "val": {"acc_0": round(best["acc_0"], DIGITS), "sim_accept_len": round(best["sim_accept_len"], DIGITS)},
        "tokens_trained": train["tokens_trained"],
        "steps": train["step"],
        "samples": merge["train_records"],
        "answer_tokens_mean": round(merge["masked_tokens"] / max(1, merge["records"]), 1),
        "hidden_state_bytes": merge["hidden_state_bytes"],
    }


def tau_vs_data(summary: dict[str, Any]) -> dict[str, list[dict[str, float]]]:
    """{eval set: [one row of the training tokens and each method's τ]} of a run's summary."""
    methods = {"chain": "tau", "tree": "tree_tau", "prompt_lookup": "ngram_tau"}
    return {name: [{"train_tokens": summary["tokens_trained"], **{m: row[key] for m, key in methods.items() if key in row}}]
            for name, row in summary.items() if has_tau(row)}


def read_metrics(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    data = read_json(path)
    missing = [key for key in keys if key not in data]
    if missing:
        raise UserError(f"{path}: lacks {missing}; it was written by an older version of its stage, run `dvc repro -f` on it")
    return data


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.summary", description=__doc__.splitlines()[0])
    parser.add_argument("train", type=Path, help="train's metrics, e.g. dvclive/train/metrics.json")
    parser.add_argument("merge", type=Path, help="merge's statistics, e.g. metrics/merge/metrics.json")
    parser.add_argument("evaluate", type=Path, help="evaluate's metrics, e.g. dvclive/evaluate/metrics.json")
    parser.add_argument("out", type=Path, help="the summary, e.g. metrics/summary.json")
    parser.add_argument("--tau-vs-data", type=Path, help="folder of one τ-vs-training-tokens row per eval set")
    args = parser.parse_args(argv)
    summary = headline(read_metrics(args.train, ("best", "tokens_trained", "step")),
                       read_metrics(args.merge, ("hidden_state_bytes", "train_records", "masked_tokens", "records")),
                       read_json(args.evaluate))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, summary)
    if args.tau_vs_data:
        with atomic_dir(args.tau_vs_data) as tmp:
            for name, rows in tau_vs_data(summary).items():
                write_json(tmp / f"{name}.json", rows)
