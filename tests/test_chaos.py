"""Kill-and-resume for every stage under real `dvc repro` (``pytest -m chaos``).

On the tiny pipeline: one uninterrupted `dvc repro` records every output's hash; then each stage
in turn is forced to run again, its process group is killed at a seeded random point of its
command (SIGKILL, SIGTERM or SIGINT), no process of the stage may be left, and running it again
must finish it into exactly the bytes of the uninterrupted run (clock values aside: tokens/s).
The rerun is forced too: a plain `dvc repro` would check the reference outputs out of the DVC
cache (dvc.lock still records them) without running the stage at all.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import time

import pytest
import yaml

from support.pipeline import FAST, SMALL, add_dataset, overrides
from support.processes import kill_when, stage_processes, start_repro
from support.repo import run

SEED = 13
STAGES = ["prompts", "generate", "extract", "merge", "train", "evaluate", "summary"]  # foreach stages: their one shard
CLOCK = ("tokens_per_s", "speedup", "seconds")  # metric names that measure time, not content
TIMED_OUTS = ("dvclive/train", "dvclive/evaluate", "metrics/summary.json")  # outputs holding clock values


def stage_name(repo, stage: str) -> str:
    shard = yaml.safe_load((repo / "params.yaml").read_text())["dataset"]["shards"][0]
    return f"{stage}@{shard}" if stage in ("generate", "extract") else stage


def recorded(repo) -> dict[str, str]:
    """Every output DVC recorded in dvc.lock: path -> md5, except the metrics holding clock values."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {out["path"]: out["md5"] for stage in lock["stages"].values() for out in stage.get("outs", [])
            if out["path"] not in TIMED_OUTS}


def timed_content(repo) -> dict[str, object]:
    """The metrics that hold clock values, with those values left out."""
    content: dict[str, object] = {}
    for name in ("dvclive/train/metrics.json", "dvclive/evaluate/metrics.json", "metrics/summary.json"):
        content[name] = without_clock(json.loads((repo / name).read_text()))
    for tsv in sorted((repo / "dvclive/train/plots/metrics").rglob("*.tsv")):
        if not tsv.name.startswith(CLOCK):
            content[str(tsv.relative_to(repo))] = tsv.read_text()
    for plot in sorted((repo / "dvclive").glob("*/plots/custom/**/*.json")):  # per-position and tau plots: no clock
        if plot.parent.name != "speedup":  # speedup per batch size: clock
            content[str(plot.relative_to(repo))] = plot.read_text()
    return content


def without_clock(metrics):
    if isinstance(metrics, dict):
        return {k: without_clock(v) for k, v in metrics.items() if not any(k.endswith(c) for c in CLOCK)}
    return metrics


def timed_run(repo, stage: str) -> tuple[float, float]:
    """`dvc repro -s stage`: (seconds until the stage's command started, seconds it ran)."""
    began = time.monotonic()
    process = start_repro(repo, "-s", stage)
    while not stage_processes(repo, stage) and process.poll() is None:
        time.sleep(0.05)
    started = time.monotonic()
    assert process.wait() == 0, f"dvc repro -s {stage} failed"
    return started - began, time.monotonic() - started


@pytest.mark.chaos
@pytest.mark.slow
def test_every_stage_killed_at_random_resumes_to_the_same_bytes(make_project):
    repo = make_project(*FAST[1:])
    add_dataset(repo, SMALL)
    run(["eagle3", "params", *overrides(*FAST, "dataset=small")], repo)
    run(["dvc", "repro", "verifier"], repo)
    durations = {stage: timed_run(repo, stage_name(repo, stage))[1] for stage in STAGES}
    reference, reference_timed = recorded(repo), timed_content(repo)
    assert "data/hidden_states/000000-000008" in reference and "models/drafter" in reference

    rng = random.Random(SEED)
    for stage in map(lambda s: stage_name(repo, s), STAGES):
        if stage == "train":  # start training afresh: the finished run's checkpoint would only be re-exported
            shutil.rmtree(repo / ".eagle3" / "checkpoints", ignore_errors=True)
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
        delay = rng.uniform(0.1, 0.9) * durations[stage.split("@")[0]]
        killed = start_repro(repo, "-f", "-s", stage)
        kill_when(killed, lambda: bool(stage_processes(repo, stage)), timeout=120, delay=delay, sig=sig)
        deadline = time.monotonic() + 10  # the stage's own watchdog polls its launcher every second
        while stage_processes(repo, stage) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not stage_processes(repo, stage), f"{stage}: processes left after {sig.name}: {stage_processes(repo, stage)}"
        rerun = run(["dvc", "repro", "-f", "-s", stage], repo, check=False)
        assert rerun.returncode == 0, f"{stage} after {sig.name} at {delay:.1f} s:\n{rerun.stdout}\n{rerun.stderr}"
        assert f"Running stage '{stage}'" in rerun.stdout  # ran, not restored
        assert recorded(repo) == reference, f"{stage} after {sig.name} at {delay:.1f} s"
    assert timed_content(repo) == reference_timed
    assert "up to date" in run(["dvc", "status"], repo).stdout

    # A rerun over the finished training run: trains nothing, same bytes and metrics, exit 0.
    forced = run(["dvc", "repro", "-f", "-s", "train"], repo)
    assert "at step 4" in forced.stderr and " loss " not in forced.stderr, forced.stderr[-2000:]
    assert recorded(repo) == reference and timed_content(repo) == reference_timed
