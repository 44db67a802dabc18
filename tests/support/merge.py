"""A temporary repo of the project's extract and merge stage blocks over two generated shards, and what a killed extract leaves."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from support.data import conversation, write_generated
from support.repo import ROOT, project_params

SHARDS = ["000000-000004", "000004-000008"]


def run(repo: Path, *command: str) -> str:
    """``command`` in ``repo`` with this interpreter's tools first on PATH; its stdout and stderr (it must succeed)."""
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


def plant_leftover(shard_dir: Path) -> Path:
    """What a killed ``extract`` leaves: its temporary folder, named with the pid of a dead process."""
    process = subprocess.Popen(["true"])
    process.wait()
    leftover = shard_dir.parent / f".{shard_dir.name}.tmp-{process.pid}-x1y2z3"
    leftover.mkdir(parents=True)
    (leftover / "part-00000.safetensors").write_bytes(os.urandom(4096))
    return leftover
