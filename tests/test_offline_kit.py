"""benchmarks/offline: the wheels an offline host lacks are this environment's requirement closure minus
what the host has, pinned to the versions installed here."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "benchmarks" / "offline" / "wheels.py"


def needed(tmp_path: Path, have: str, *args: str) -> list[str]:
    (tmp_path / "have.txt").write_text(have)
    out = subprocess.run([sys.executable, str(WHEELS), "--have", str(tmp_path / "have.txt"), *args],
                         capture_output=True, text=True, check=True).stdout
    return out.split()


def test_the_closure_is_pinned_and_leaves_out_what_the_host_has(tmp_path):
    everything = needed(tmp_path, "", "hydra-core")
    assert f"hydra-core=={version('hydra-core')}" in everything
    assert f"omegaconf=={version('omegaconf')}" in everything  # hydra-core's requirement, and omegaconf's next:
    assert any(line.startswith("antlr4-python3-runtime==") for line in everything)
    fewer = needed(tmp_path, "PyYAML, omegaconf\npackaging", "hydra-core")  # names as a host lists them
    assert not any(line.startswith(("omegaconf==", "pyyaml==", "packaging==")) for line in fewer)
    assert needed(tmp_path, "omegaconf", "hydra-core", "--carry", "omegaconf") == everything


def test_a_root_not_installed_here_is_refused_by_name(tmp_path):
    (tmp_path / "have.txt").write_text("")
    result = subprocess.run([sys.executable, str(WHEELS), "--have", str(tmp_path / "have.txt"), "no-such-package-eagle3"],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert "no-such-package-eagle3 is required but not installed here" in result.stderr


def test_a_left_out_requirement_takes_what_only_it_needs_along(tmp_path):
    everything = needed(tmp_path, "", "dvc")
    assert any(line.startswith("pygit2==") for line in everything) and any(line.startswith("cffi==") for line in everything)
    lean = needed(tmp_path, "", "dvc", "--leave", "pygit2", "asyncssh")
    assert not any(line.startswith(("pygit2==", "asyncssh==", "cryptography==", "cffi==", "pycparser==")) for line in lean)
    assert set(lean) < set(everything) and f"dvc=={version('dvc')}" in lean
