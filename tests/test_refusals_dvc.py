"""A stage that refuses its inputs keeps the outputs of its last good run, and `dvc status` still shows it
stale: real `dvc repro` in a temporary git repo (tiny random verifier, a local prompt file).

DVC deletes a stage's outputs before running its command; `prompts`' and `evaluate`'s are `persist`ent,
so DVC leaves them and the stage replaces them atomically only when it succeeds. A kill is still
finished by the next `dvc repro` with the bytes of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.pipeline import FAST, LOCAL_SOURCE, add_dataset, overrides, stage_lines, write_local_prompts
from support.processes import kill_when, stage_processes, start_repro
from support.repo import run
from support.train import folder_bytes

QUICK = {"name": "quick", "shards": ["000000-000004"], **LOCAL_SOURCE}
PROMPTS = ("data/prompts", "metrics/prompts.json")


def quick_project(make_project, *choices: str) -> Path:
    repo = make_project(name="quick")
    add_dataset(repo, QUICK)
    write_local_prompts(repo, 12)
    run(["eagle3", "params", *overrides("model=tiny-random", "dataset=quick", *choices)], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "quick dataset"], repo)
    return repo


def outputs(repo: Path, names) -> dict[str, dict[str, bytes]]:
    return {name: folder_bytes(repo / name) if (repo / name).is_dir() else {"": (repo / name).read_bytes()} for name in names}


def error_lines(result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_malformed_source_line_keeps_the_last_good_prompts(make_project):
    repo = quick_project(make_project)
    run(["dvc", "repro", "prompts"], repo)
    good = outputs(repo, PROMPTS)
    source = repo / "data" / "sources" / "prompts.jsonl"
    committed = source.read_text()
    source.write_text(committed + '{"messages": [\n')

    refused = run(["dvc", "repro", "prompts"], repo, check=False)
    assert refused.returncode != 0 and stage_lines(refused.stdout) == ["prompts"], refused.stdout
    assert error_lines(refused) == [line for line in error_lines(refused) if line.startswith(f"error: {source.relative_to(repo)}:13: ")]
    assert len(error_lines(refused)) == 1, refused.stderr
    assert outputs(repo, PROMPTS) == good  # DVC removed nothing, the stage wrote nothing
    assert "up to date" not in run(["dvc", "status", "prompts"], repo).stdout  # still stale: its command failed

    source.write_text(committed)  # mended: the recorded run describes the outputs again
    assert "up to date" in run(["dvc", "status", "prompts"], repo).stdout


@pytest.mark.slow
def test_a_killed_prompts_run_is_finished_with_an_uninterrupted_runs_bytes(make_project):
    repo = quick_project(make_project)
    run(["dvc", "repro", "prompts"], repo)
    write_local_prompts(repo, 16)  # a change: the rerun writes other prompts over the persistent ones
    repro = start_repro(repo, "prompts")
    kill_when(repro, lambda: bool(stage_processes(repo, "prompts")), timeout=120, delay=1.0)  # while it reads the sources
    assert "up to date" not in run(["dvc", "status", "prompts"], repo).stdout
    run(["dvc", "repro", "prompts"], repo)
    finished = outputs(repo, PROMPTS)
    assert not list((repo / "data").glob(".prompts.tmp-*"))
    run(["dvc", "repro", "-f", "prompts"], repo)  # uninterrupted
    assert outputs(repo, PROMPTS) == finished
    assert json.loads((repo / "metrics" / "prompts.json").read_text())["sources"]


@pytest.mark.slow
def test_an_unknown_key_and_a_refused_drafter_keep_the_trained_and_measured_outputs(make_project):
    repo = quick_project(make_project, *FAST[1:])
    run(["dvc", "repro", "evaluate"], repo)
    trained = ("models/drafter", "dvclive/train", "dvclive/evaluate", "data/merged")
    good, lock = outputs(repo, trained), (repo / "dvc.lock").read_bytes()

    # A misspelt key (the `+` form DVC suggests): refused by `params`, before DVC deletes anything.
    choices = overrides("model=tiny-random", "dataset=quick", *FAST[1:])
    for bad, known in (("+train.lrr=0.1", "train.lr"), ("+merge.draft_vocab_sise=256", "merge.draft_vocab_size")):
        refused = run(["dvc", "exp", "run", *choices, "-S", bad], repo, check=False)
        assert refused.returncode != 0 and stage_lines(refused.stdout) == ["params"], (bad, refused.stdout)
        (line,) = error_lines(refused)
        assert line.startswith(f"error: params.yaml: {bad[1:].split('=')[0]}: unknown key (did you mean {known}?); "), line
        assert outputs(repo, trained) == good and (repo / "dvc.lock").read_bytes() == lock, bad
        run(["git", "checkout", "params.yaml"], repo)

    # A drafter evaluate refuses (a file of its export gone): its last measurement stays, the stage stale.
    (repo / "models" / "drafter" / "config.json").unlink()
    refused = run(["dvc", "repro", "-s", "evaluate"], repo, check=False)
    assert refused.returncode != 0 and error_lines(refused)[0].startswith("error: models/drafter: "), refused.stderr
    assert outputs(repo, ["dvclive/evaluate"]) == {"dvclive/evaluate": good["dvclive/evaluate"]}
    assert "up to date" not in run(["dvc", "status", "evaluate"], repo).stdout
    run(["dvc", "checkout", "models/drafter"], repo)
    assert "up to date" in run(["dvc", "status", "evaluate"], repo).stdout
