"""Scaling the dataset re-extracts only the new shards: a real ``dvc repro`` of the project's own
extract and merge stage blocks, in a temporary git repository, with the tiny verifier."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from eagle3.common import read_jsonl

from conftest import ROOT, project_params
from test_extract import conversation, write_generated

SHARDS = ["000000-000004", "000004-000008"]


def run(repo: Path, *command: str) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def write_params(repo: Path, tiny_model_params, shards: list[str]) -> None:
    params = project_params()
    params.model = tiny_model_params
    params.dataset.shards = shards
    params.extract.batch_tokens = 512
    params.merge.val_fraction = 0.25
    OmegaConf.save(params, repo / "params.yaml")


def make_repo(tmp_path: Path, tiny_verifier_dir: Path, tiny_model_params, stages: tuple[str, ...] = ("extract", "merge")) -> Path:
    """The project's extract and merge stages (or ``stages``) over two generated shards; params list the first."""
    repo = tmp_path / "repo"
    repo.mkdir()
    declared = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {name: declared[name] for name in stages}}))
    # The stages' code deps (the code that runs is the installed eagle3).
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for file in (".dvcignore", ".gitignore"):
        shutil.copy(ROOT / file, repo)
    shutil.copytree(tiny_verifier_dir, repo / "models" / "verifier")
    for n, shard in enumerate(SHARDS):
        write_generated(repo / "data" / "generated" / shard, [conversation(4 * n + i) for i in range(4)])
    write_params(repo, tiny_model_params, SHARDS[:1])
    run(repo, "git", "init", "-q")
    run(repo, "dvc", "init", "-q")
    run(repo, "dvc", "config", "cache.type", "hardlink")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")  # dvclive needs a commit
    return repo


@pytest.mark.slow
def test_second_shard_is_the_only_one_extracted(tmp_path, tiny_verifier_dir, tiny_model_params):
    repo = make_repo(tmp_path, tiny_verifier_dir, tiny_model_params)
    first = run(repo, "dvc", "repro")
    assert f"Running stage 'extract@{SHARDS[0]}'" in first and "Running stage 'merge'" in first
    part = next((repo / "data" / "hidden_states" / SHARDS[0]).glob("part-*.safetensors"))
    before = part.stat().st_ino, part.stat().st_mtime_ns

    write_params(repo, tiny_model_params, SHARDS)
    second = run(repo, "dvc", "repro")
    assert f"Running stage 'extract@{SHARDS[1]}'" in second and "Running stage 'merge'" in second
    assert f"Running stage 'extract@{SHARDS[0]}'" not in second
    assert (part.stat().st_ino, part.stat().st_mtime_ns) == before
    rows = list(read_jsonl(repo / "data" / "merged" / "manifest.jsonl"))
    assert {row["shard"] for row in rows} == set(SHARDS) and len(rows) == 8

    # merge's statistics are a plain output now (the summary stage holds the DVC metrics)
    assert "vocab_coverage" in (repo / "metrics" / "merge" / "metrics.json").read_text()
    assert "up to date" in run(repo, "dvc", "status")


def plant_leftover(shard_dir: Path) -> Path:
    """What a killed ``extract`` leaves: its temporary folder, named with the pid of a dead process."""
    process = subprocess.Popen(["true"])
    process.wait()
    leftover = shard_dir.parent / f".{shard_dir.name}.tmp-{process.pid}-x1y2z3"
    leftover.mkdir(parents=True)
    (leftover / "part-00000.safetensors").write_bytes(os.urandom(4096))
    return leftover


@pytest.mark.slow
def test_a_killed_extracts_leftover_never_enters_a_hash(tmp_path, tiny_verifier_dir, tiny_model_params):
    repo = make_repo(tmp_path, tiny_verifier_dir, tiny_model_params)
    hidden = repo / "data" / "hidden_states"
    rerun = plant_leftover(hidden / SHARDS[0])  # its shard is extracted again: deleted before writing
    other = plant_leftover(hidden / SHARDS[1])  # a shard the params do not list: stays, ignored
    run(repo, "dvc", "repro")
    assert not rerun.exists() and other.exists()
    merge_dep = next(d for d in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["merge"]["deps"]
                     if d["path"] == "data/hidden_states")
    assert merge_dep["nfiles"] == sum(1 for p in hidden.rglob("*") if p.is_file() and ".tmp-" not in str(p))
    assert "up to date" in run(repo, "dvc", "status")
    plant_leftover(hidden / SHARDS[0])  # after the run, e.g. a kill of a `dvc repro -f`
    assert "up to date" in run(repo, "dvc", "status")
    assert ".tmp-" not in run(repo, "git", "status", "--porcelain", "--untracked-files=all")
