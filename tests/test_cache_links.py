"""The committed DVC config links outputs from the cache by hardlink where it can and copies where
it cannot (a cache on another filesystem): a real ``dvc repro`` in a temporary repository."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from support.repo import ROOT, run

OTHER_FILESYSTEM = Path("/dev/shm")  # a tmpfs on Linux: no hardlink reaches it from the test's folder


def test_committed_cache_types_fall_back_to_copy(tmp_path: Path):
    if not OTHER_FILESYSTEM.is_dir() or OTHER_FILESYSTEM.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip(f"{OTHER_FILESYSTEM} is not another filesystem here")
    repo = tmp_path / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    cache = Path(tempfile.mkdtemp(prefix="eagle3-cache-", dir=OTHER_FILESYSTEM))
    try:
        run(["dvc", "config", "--local", "cache.dir", str(cache)], repo)
        run(["dvc", "stage", "add", "-q", "-n", "states", "-o", "states", "mkdir states && echo 1 > states/part"], repo)
        run(["dvc", "repro"], repo)  # hardlink alone: "No possible cache link types for 'states'"
        assert (repo / "states" / "part").read_text() == "1\n"
        assert "up to date" in run(["dvc", "status"], repo).stdout
    finally:
        shutil.rmtree(cache)
