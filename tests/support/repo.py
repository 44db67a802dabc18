"""This checkout, seen from the tests: its root, the test cache, its committed params, running commands in a repo, a new one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EAGLE3_TEST_CACHE", ROOT / ".eagle3" / "cache"))


def with_sources(**more: str) -> dict[str, str]:
    """This environment with the checkout's ``src`` first on PYTHONPATH (and ``more``), for a Python started by a test.
    Why prepend: where the packages themselves come by PYTHONPATH (a GPU host's carried wheels), replacing it left the
    child without them."""
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **more}


def project_params():
    """The committed params.yaml (the demo defaults) as an OmegaConf object."""
    return OmegaConf.load(ROOT / "params.yaml")


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command (dvc, git, python -m ...) in ``cwd`` (in ``env``, else this environment); on failure show its output."""
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def git_dvc_repo(path: Path) -> Path:
    """A new, empty git + DVC repo at ``path`` (branch main)."""
    path.mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], path)
    run(["dvc", "init", "-q"], path)
    return path
