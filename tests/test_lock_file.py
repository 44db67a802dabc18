"""A dvc.lock that a kill of DVC left empty or cut short (DVC truncates it, then writes it) is named by
every `eagle3` command and by a stage run by hand, in one line saying how to mend it; the mend works
(real `dvc` commands in a temporary git repo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.common import MEND_LOCK
from eagle3.launch import USER_ERROR
from support.repo import ROOT, git_dvc_repo, run

DVC_YAML = """stages:
  copy:
    cmd: cp a b
    deps: [a]
    outs: [b]
  again:
    cmd: cp b c
    deps: [b]
    outs: [c]
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = git_dvc_repo(tmp_path / "repo")
    (repo / "dvc.yaml").write_text(DVC_YAML)
    (repo / "a").write_text("a file\n")
    run(["dvc", "repro", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "run"], repo)
    return repo


def damages(lock: str) -> dict[str, str]:
    """What a kill while DVC writes dvc.lock leaves and DVC refuses: nothing, a cut inside a quoted value
    (not YAML), a cut after a key (its value null). A cut that DVC still reads loses only the entries
    after it: DVC reruns those stages, as it does after any kill."""
    after_size = lock.index("size:") + len("size:")
    return {"empty": "", "cut in a quote": lock[: lock.index("'2.0'") + 2], "cut after a key": lock[:after_size]}


def eagle3_lines(repo: Path, *argv: str) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, *argv], cwd=repo, capture_output=True, text=True)
    return result.returncode, result.stderr.splitlines()


def test_a_damaged_lock_file_is_named_with_its_mend(repo):
    lock = (repo / "dvc.lock").read_text()
    for damage, text in damages(lock).items():
        (repo / "dvc.lock").write_text(text)
        assert run(["dvc", "status"], repo, check=False).returncode != 0, damage  # DVC itself stops on it
        status, lines = eagle3_lines(repo, "-m", "eagle3.cli", "params", "--conf", str(ROOT / "conf"), "--output", "p.yaml")
        assert status == 1 and len(lines) == 1 and lines[0].startswith("error: dvc.lock: "), (damage, lines)
        assert lines[0].endswith(MEND_LOCK) and not (repo / "p.yaml").exists(), lines
        status, by_hand = eagle3_lines(repo, "-m", "eagle3.params", "data/params.ok", "--conf", "conf", "--sources", "data/sources")
        assert status == USER_ERROR and by_hand == lines, (damage, by_hand)
        run(["git", "checkout", "dvc.lock"], repo)  # what the line says
        assert "up to date" in run(["dvc", "status"], repo).stdout


def test_an_empty_and_a_cut_lock_file_are_told_apart(repo):
    lock = (repo / "dvc.lock").read_text()
    expected = {"empty": "empty", "cut in a quote": "cut short or damaged (not readable YAML)", "cut after a key": "cut short or damaged (not DVC's lock-file "
                "schema at stages -> copy -> deps -> 0 -> size)"}
    for damage, text in damages(lock).items():
        (repo / "dvc.lock").write_text(text)
        _, (line,) = eagle3_lines(repo, "-m", "eagle3.cli", "gc", "--dry-run")
        assert line.startswith(f"error: dvc.lock: {expected[damage]}"), (damage, line)


def test_a_valid_or_absent_lock_file_passes(repo):
    from eagle3.common import check_lock_file

    check_lock_file(repo / "dvc.lock")
    check_lock_file(repo / "none.lock")


def test_a_cut_that_dvc_still_reads_is_named(repo):
    """A cut at a line end inside the last stage's entry fits DVC's schema and DVC reads it, taking the stage for
    changed; every `eagle3` command names it."""
    lines = (repo / "dvc.lock").read_text().splitlines(keepends=True)
    read_by_dvc = 0
    for cut in range(lines.index("  again:\n") + 2, len(lines)):
        (repo / "dvc.lock").write_text("".join(lines[:cut]))
        status = run(["dvc", "status"], repo, check=False)
        read_by_dvc += status.returncode == 0 and "again" in status.stdout  # no error of DVC's own: the stage "changed"
        code, (line,) = eagle3_lines(repo, "-m", "eagle3.cli", "gc", "--dry-run")
        assert code == 1 and line.startswith("error: dvc.lock: cut short"), (cut, line)
        assert line.endswith(MEND_LOCK), line
    assert read_by_dvc >= 3


def test_every_cut_of_the_demo_lock_file_is_named(tmp_path):
    """The committed demo's dvc.lock cut where kills of DVC left it (one 8 KiB write buffer and its multiples, mid-line)
    and at line ends throughout (the cuts that leave whole lines): named, unless the cut falls between two stages
    (DVC reruns the stages after it, as after any kill)."""
    from eagle3.common import UserError, check_lock_file

    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    text = (ROOT / "dvc.lock").read_text()
    lines = text.splitlines(keepends=True)
    line_ends = {len("".join(lines[:i])): lines[i].startswith("  ") and lines[i][2] != " " for i in range(3, len(lines), 37)}
    for size, between_stages in {**{size: False for size in (8192, 24576, 32768, 40960)}, **line_ends}.items():
        (tmp_path / "dvc.lock").write_text(text[:size])
        if between_stages:
            check_lock_file(tmp_path / "dvc.lock")
            continue
        with pytest.raises(UserError, match="dvc.lock: cut short"):
            check_lock_file(tmp_path / "dvc.lock")
