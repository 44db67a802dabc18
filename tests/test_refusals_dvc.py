"""A stage that refuses its inputs keeps the outputs of its last good run, and `dvc status` still shows it
stale: real `dvc repro` in a temporary git repo (tiny random verifier, a local prompt file).

DVC deletes a stage's outputs before running its command; `prompts`' and `evaluate`'s are `persist`ent,
so DVC leaves them and the stage replaces them atomically only when it succeeds. Whatever else a stage
would refuse, the `params` stage refuses before DVC deletes anything; a stage run alone (`dvc repro -s`,
no `params` first) says how to bring back what DVC deleted. A kill is still finished by the next
`dvc repro` with the bytes of an uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from eagle3.params import RESTORE
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


TRAINED = ("models/verifier", "data/prompts", "data/generated", "data/hidden_states", "data/merged", "models/drafter",
           "dvclive/train")
BASE = ["dataset=quick", *FAST[1:]]  # `dvc exp run -S` composes from the defaults: repeat the choices
STAGE_WOULD_REFUSE = [  # (-S overrides, the start of the one line): each once refused by a stage after DVC removed outputs
    (["model=tiny-random", "~train.lr"], "params.yaml: train.lr: missing (conf/ composes it for train=debug)"),
    (["model=tiny-random", "train.lr=inf"], "params.yaml: train.lr = inf: must be a finite number"),
    (["model=tiny-random", "train.lr=1e400"], "params.yaml: train.lr = inf: must be a finite number"),
    (["model=tiny-random", "train.weight_decay=inf"], "params.yaml: train.weight_decay = inf: must be a finite number"),
    (["model=tiny-random", "generate.temperature=inf"], "params.yaml: generate.temperature = inf: must be a finite number"),
    (["model=tiny-random", "model.source.kind=rnadom"],
     "params.yaml: model.source.kind = 'rnadom': must be one of ['pypi-gguf', 'hf', 'random']"),
    (["model=tiny-random", "model.source.tokenizer=/nonexistent/tokenizer"],
     "model.source.tokenizer: /nonexistent/tokenizer is not an HF folder with a tokenizer"),
    (["model=tiny-random", "model.source.kind=hf", "+model.source.id=/nonexistent/verifier"],
     "model.source.id: folder /nonexistent/verifier does not exist"),
    (["model=smollm2-135m", "model.source.file=missing.gguf"], "model.source: "),  # the GGUF's package, without the file
    (["model=tiny-random", "dataset.eval_sets.heldout=0"], "params.yaml: evaluate.sets = ['heldout', 'humaneval', 'math']: "
                                                          "must be sets with prompts"),
] + ([] if torch.cuda.is_available() else [
    (["model=tiny-random", "layout=gpu1"], "params.yaml: layout.device = 'cuda': this machine has no CUDA device"),
])


@pytest.mark.slow
def test_what_a_stage_would_refuse_is_refused_before_dvc_removes_anything_or_named_with_its_mend(make_project):
    repo = quick_project(make_project, *FAST[1:])
    run(["dvc", "repro", "train"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "trained"], repo)  # dvclive/train (uncached) with the lock file
    good, lock = outputs(repo, TRAINED), (repo / "dvc.lock").read_bytes()

    for bad, start in STAGE_WOULD_REFUSE:
        refused = run(["dvc", "exp", "run", *overrides(*BASE, *bad)], repo, check=False)
        assert refused.returncode != 0 and stage_lines(refused.stdout) == ["params"], (bad, refused.stdout, refused.stderr)
        (line,) = error_lines(refused)
        assert line.startswith(f"error: {start}") and line.endswith(RESTORE), (bad, line)
        assert outputs(repo, TRAINED) == good and (repo / "dvc.lock").read_bytes() == lock, bad
        run(["git", "checkout", "params.yaml"], repo)

    # A line deleted by hand, and `dvc repro` (no -S).
    params = repo / "params.yaml"
    params.write_text("".join(line for line in params.read_text().splitlines(keepends=True) if not line.startswith("  lr: ")))
    refused = run(["dvc", "repro"], repo, check=False)
    assert stage_lines(refused.stdout) == ["params"] and error_lines(refused)[0].startswith("error: params.yaml: train.lr: missing")
    assert outputs(repo, TRAINED) == good and (repo / "dvc.lock").read_bytes() == lock
    run(["git", "checkout", "params.yaml"], repo)

    # `dvc repro -s train` skips `params`: DVC removes train's outputs, then train refuses a misspelt key; its line
    # names the two commands that bring them back, byte for byte.
    misspelt = yaml.safe_load(params.read_text())
    misspelt["train"]["lrr"] = 0.1
    params.write_text(yaml.safe_dump(misspelt, sort_keys=False))

    refused = run(["dvc", "repro", "-s", "train"], repo, check=False)
    assert refused.returncode != 0 and stage_lines(refused.stdout) == ["train"], refused.stdout
    (line,) = error_lines(refused)
    assert line.startswith("error: params.yaml: train.lrr: unknown key (did you mean train.lr?); ") and line.endswith(
        "; DVC removed train's outputs before running it: `dvc checkout train` brings back the recorded ones, "
        "`git checkout dvclive/train` the uncached ones"), line
    assert not (repo / "models" / "drafter").exists()  # what no check at the stage's start can keep

    run(["git", "checkout", "params.yaml"], repo)
    run(["dvc", "checkout", "train"], repo)
    run(["git", "checkout", "dvclive/train"], repo)
    assert outputs(repo, TRAINED) == good
    assert "up to date" in run(["dvc", "status", "train"], repo).stdout
