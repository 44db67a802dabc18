"""params.yaml under real `dvc repro` and `dvc exp run -S` (tiny random verifier, temporary git repo).

A bad value stops the run at the `params` stage, before DVC removes any stage's outputs, and says
how to restore params.yaml; a valid change reruns only what declares it; a params.yaml rewritten
while a stage runs (a concurrent `dvc exp run`, refused by DVC's lock) fails that stage instead
of being recorded for outputs made with the old values.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from support.processes import stage_processes
from support.repo import project_params, run
from eagle3.params import PARAMS, RESTORE
from support.pipeline import LOCAL_SOURCE, add_dataset, overrides, stage_lines, write_local_prompts
from support.train import folder_bytes

QUICK = {"name": "quick", "shards": ["000000-000004"], **LOCAL_SOURCE}
CHOICES = ["model=tiny-random", "dataset=quick"]  # `dvc exp run -S` composes from the defaults: repeat them


def quick_project(make_project) -> Path:
    repo = make_project(name="quick")
    add_dataset(repo, QUICK)
    write_local_prompts(repo, 12)
    run(["eagle3", "params", *overrides(*CHOICES)], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "quick dataset"], repo)
    return repo


def test_the_params_stage_declares_every_section():
    assert set(PARAMS) == set(project_params())


@pytest.mark.slow
def test_a_bad_exp_run_value_stops_before_any_output_is_removed(make_project):
    repo = quick_project(make_project)
    run(["dvc", "repro", "prompts"], repo)
    outputs = {name: folder_bytes(repo / name) for name in ("models/verifier", "data/prompts")}
    committed = (repo / "params.yaml").read_bytes()
    bad_runs = [
        ["dataset.heldout_fraction=2"],  # a param of prompts, whose outputs DVC would delete first
        ["train.lr=0.001", "evaluate.tree.num_draft_tokens=1"],  # an impossible tree: once refused only after training
        ["model.aux_layers=[0,1,2]"],  # layer 0: once refused only at export
    ]
    for bad in bad_runs:
        failed = run(["dvc", "exp", "run", *overrides(*CHOICES, *bad)], repo, check=False)
        assert failed.returncode != 0 and stage_lines(failed.stdout) == ["params"], (bad, failed.stdout, failed.stderr)
        (line,) = [line for line in failed.stderr.splitlines() if line.startswith("error:")]
        assert line.startswith("error: params.yaml: ") and line.endswith(RESTORE), line
        assert {name: folder_bytes(repo / name) for name in outputs} == outputs, bad
        run(["git", "checkout", "params.yaml"], repo)  # the one command the error names
        assert (repo / "params.yaml").read_bytes() == committed
        assert "up to date" in run(["dvc", "status", "prompts"], repo).stdout

    # A valid change of a key prompts does not declare runs the check and nothing else.
    run(["eagle3", "params", *overrides(*CHOICES, "train.lr=0.001")], repo)
    assert stage_lines(run(["dvc", "repro", "prompts"], repo).stdout) == ["params"]
    assert {name: folder_bytes(repo / name) for name in outputs} == outputs


def wait_for(found, timeout: float, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not found():
        assert process.poll() is None and time.monotonic() < deadline, "the stage ended before the check point"
        time.sleep(0.01)


@pytest.mark.slow
def test_params_rewritten_while_a_stage_runs_are_not_recorded(make_project, tmp_path):
    """`dvc exp run -S` during `dvc repro`: DVC's lock refuses it, but it has rewritten params.yaml."""
    repo = quick_project(make_project)
    log = (tmp_path / "repro.log").open("w+")
    repro = subprocess.Popen(["dvc", "repro", "verifier"], cwd=repo, start_new_session=True, stdout=log, stderr=log, text=True)
    wait_for(lambda: list((repo / "models").glob(".verifier.tmp-*")), 120, repro)  # it has read its params
    stage = stage_processes(repo, "verifier")
    for pid in stage:  # hold the stage, so that the concurrent run lands while it is running
        os.kill(pid, signal.SIGSTOP)
    try:
        concurrent = run(["dvc", "exp", "run", *overrides(*CHOICES, "model.name=renamed")], repo, check=False)
    finally:
        for pid in stage:
            os.kill(pid, signal.SIGCONT)
    assert concurrent.returncode != 0, concurrent.stdout
    assert yaml.safe_load((repo / "params.yaml").read_text())["model"]["name"] == "renamed"
    assert repro.wait(timeout=300) != 0
    log.seek(0)
    errors = [line for line in log.read().splitlines() if line.startswith("error:")]
    assert errors == ["error: params.yaml: changed while this stage ran (model.name 'tiny-random' -> 'renamed'): its outputs "
                      "are of the values it started with, so nothing is recorded; run `dvc repro` again for the new values, "
                      "or first `git checkout params.yaml` for the old ones"], errors
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert "verifier" not in lock and "params" in lock
    assert "verifier" in run(["dvc", "status", "verifier"], repo).stdout  # not "up to date"
