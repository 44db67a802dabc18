"""benchmarks/offline: the wheels an offline host lacks are this environment's requirement closure minus
what the host has, pinned to the versions installed here; the vLLM kit's wheel stripped, packed in pieces and installed
once all are there."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

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


STRIP = ROOT / "benchmarks" / "offline" / "strip_wheel.py"
PACK = ROOT / "benchmarks" / "offline" / "pack_parts.sh"
INSTALL = ROOT / "benchmarks" / "offline" / "vllm_install.sh"
GUARDED = "vllm/v1/structured_output/backend_guidance.py"


def stand_in_vllm(folder: Path) -> Path:
    """A wheel laid out as vLLM's where the kit touches it (a kernel to strip, the module whose import is guarded, an
    incompressible file that makes the kit several pieces), and nothing of vLLM's code: vLLM cannot run here."""
    files = {"vllm/__init__.py": b"__version__ = '0.0.1'\n",
             GUARDED: b"import os\nfrom transformers import MistralCommonBackend\n\nGUARDED = True\n",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": os.urandom(3000),
             "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": os.urandom(3000)}
    wheel = folder / "vllm-0.0.1-py3-none-any.whl"
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items())
    meta = {"vllm-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n",
            "vllm-0.0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: eagle3-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:  # as wheels come
        for name, data in {**files, **meta}.items():
            archive.writestr(name, data)
        archive.writestr("vllm-0.0.1.dist-info/RECORD", record + "".join(f"{name},,\n" for name in meta)
                         + "vllm-0.0.1.dist-info/RECORD,,\n")
    return wheel


def test_a_stripped_wheel_lists_only_the_files_it_holds(tmp_path):
    wheel = stand_in_vllm(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    second = stand_in_vllm(other)  # each wheel named is stripped
    done = subprocess.run([sys.executable, str(STRIP), str(wheel), str(second), "--drop", "vllm/vllm_flash_attn/_vllm_fa2_C",
                           "--stored"], capture_output=True, text=True, check=True)
    assert done.stdout.count("1 files left out") == 2
    with zipfile.ZipFile(wheel) as archive:
        names, record = archive.namelist(), archive.read("vllm-0.0.1.dist-info/RECORD").decode()
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" not in names + [line.split(",")[0] for line in record.splitlines()]
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names and "_vllm_fa3_C" in record
    refused = subprocess.run([sys.executable, str(STRIP), str(wheel), "--drop", "vllm/no_such_dir/"], capture_output=True,
                             text=True)
    assert refused.returncode != 0 and "no wheel has anything under vllm/no_such_dir/" in refused.stderr
    with zipfile.ZipFile(wheel) as archive:
        assert archive.namelist() == names  # refused before anything was written


def test_the_vllm_kit_installs_once_every_piece_is_there_with_the_guard(tmp_path):
    """pack_parts.sh's pieces, brought one call at a time, in another order; vllm_install.sh installs on the last
    (with --target: the interpreter's own site stays as it was), guards the import and imports the package."""
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    stand_in_vllm(kit / "wheels")
    subprocess.run(["bash", str(PACK), str(kit), "wheels", "2000"], check=True, capture_output=True)
    parts = sorted(kit.glob("part*"))
    assert len(parts) >= 3
    env = {**os.environ, "VLLM_STORE": str(tmp_path / "store"), "VLLM_SITE": str(tmp_path / "site")}
    for i, part in enumerate(reversed(parts), 1):
        done = subprocess.run(["bash", str(INSTALL), str(part)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        if i < len(parts):
            assert f"{i} of {len(parts)} pieces" in done.stdout and not (tmp_path / "site").exists()
    assert "vllm 0.0.1" in done.stdout
    no_mistral = tmp_path / "no_mistral" / "transformers"  # a transformers without MistralCommonBackend
    no_mistral.mkdir(parents=True)
    (no_mistral / "__init__.py").write_text("")
    imported = subprocess.run([sys.executable, "-c", "import vllm.v1.structured_output.backend_guidance as m; print(m.GUARDED)"],
                              env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{no_mistral.parent}"},
                              capture_output=True, text=True)
    assert imported.stdout.strip() == "True", imported.stderr


def test_pieces_of_two_kits_are_refused_and_nothing_is_installed(tmp_path):
    kits = []
    for name in ("one", "two"):  # two packings of as many pieces: the incompressible files differ
        kit = tmp_path / name
        (kit / "wheels").mkdir(parents=True)
        stand_in_vllm(kit / "wheels")
        subprocess.run(["bash", str(PACK), str(kit), "wheels", "2000"], check=True, capture_output=True)
        kits.append(sorted(kit.glob("part*")))
    env = {**os.environ, "VLLM_STORE": str(tmp_path / "store"), "VLLM_SITE": str(tmp_path / "site")}
    mixed = [kits[0][0], *kits[1][1:]]
    for part in mixed:
        done = subprocess.run(["bash", str(INSTALL), str(part)], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "do not join into the kit's file" in done.stderr
    assert not (tmp_path / "site").exists() and not (tmp_path / "site.partial").exists()


def test_a_pip_report_is_read_for_the_environment_it_was_resolved_in(tmp_path):
    """vllm_kit.sh's resolution: pip's installation report, its markers evaluated for the host's Python (3.12 there,
    whatever runs wheels.py) and for the extras a requirement names, the host's packages and a left-out requirement
    not followed."""
    def item(name: str, version: str, *requires: str) -> dict:
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)}}

    report = {"environment": {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                              "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
                              "implementation_name": "cpython", "platform_python_implementation": "CPython",
                              "platform_release": "", "platform_version": "", "implementation_version": "3.12.3"},
              "install": [item("vllm", "0.26.0", "Mistral_Common[image]>=1", "flashinfer-python==0.6.14", "numba==0.65.0",
                               'old-only; python_version < "3.12"', "tests-only; extra == 'test'"),
                          item("mistral-common", "1.13.1", 'numpy<2.4; python_version <= "3.12"', "pycountry",
                               'pillow-simd; extra == "image"', 'soundfile; extra == "audio"'),
                          item("pycountry", "26.2.16"), item("numpy", "2.3.5"), item("pillow-simd", "9.0.0"),
                          item("flashinfer-python", "0.6.14", "cuda-tile", "pycountry"), item("cuda-tile", "1.7.0")]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    need = needed(tmp_path, "numpy, numba", "vllm", "--report", str(tmp_path / "report.json"), "--leave", "flashinfer-python")
    assert need == ["mistral-common==1.13.1", "pillow-simd==9.0.0", "pycountry==26.2.16", "vllm==0.26.0"]  # the extra named
    (tmp_path / "have.txt").write_text("numpy")  # numba is the host's, but not named: it was no stub there either
    refused = subprocess.run([sys.executable, str(WHEELS), "--have", str(tmp_path / "have.txt"), "--report",
                              str(tmp_path / "report.json"), "vllm"], capture_output=True, text=True)
    assert refused.returncode != 0 and "numba is required but not in" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("short", [False, True], ids=["timed", "short lease"])
def test_the_engine_steps_wait_for_the_run_and_hold_the_variants_until_the_timed_ones_end(tmp_path, short):
    """engine_run.sh, detached: nothing before the first run succeeds; then generate_vllm.py and serve_vllm.py at K = 7
    timed while the variants wait, then the variants released, then K = 3, 5 and 7 untimed. A short lease
    (AFTER_VARIANTS=1 SERVE_TIMED=0): nothing before the whole job (the variants too) ends, no timed serving. vLLM
    cannot run here: PYTHON is a stand-in that logs each step's arguments and whether the variants were still held."""
    run, res = tmp_path / "run", tmp_path / "res"
    (run / "logs").mkdir(parents=True)
    (run / "params.yaml").write_text("dataset: {name: 20k}\n")
    if not short:  # pipeline_run.sh's HOLD_VARIANTS=1
        (run / "logs" / "variants.hold").touch()
    calls = tmp_path / "calls.txt"
    standin = tmp_path / "python"
    standin.write_text(f'#!/bin/bash\necho "$(basename "$1") ${{*:2}} held=$([ -f {run}/logs/variants.hold ] && echo y || echo n)" >> {calls}\n')
    standin.chmod(0o755)
    env = {**os.environ, "PYTHON": str(standin), "COMMIT": "abc1234", **({"AFTER_VARIANTS": "1", "SERVE_TIMED": "0"} if short else {})}
    started = subprocess.run(["bash", str(ROOT / "benchmarks/offline/engine_run.sh"), str(run), str(res)], env=env,
                             capture_output=True, text=True, check=True)
    assert started.stdout.startswith("started: job ")
    time.sleep(1)
    assert not calls.exists()  # the run has not finished
    (run / "logs" / "pipeline.rc").write_text("0\n")
    if short:
        time.sleep(6)  # longer than the job's wait between looks
        assert not calls.exists()  # the variants have not finished
        (run / "logs" / "job.rc").write_text("0\n")
    deadline = time.time() + 60
    while not (res / "logs" / "engine.rc").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert (res / "logs" / "engine.rc").read_text() == "0\n"
    serve = f"{run} --out {res}/serve_vllm_20k.json --commit abc1234"
    assert calls.read_text().splitlines() == [
        f"generate_vllm.py {run} --out {res}/generate_vllm_openai.json --commit abc1234 held={'n' if short else 'y'}",
        *([] if short else [f"serve_vllm.py {serve} --ks 7 held=y"]),
        f"serve_vllm.py {serve} --ks 3 5 7 --concurrency held=n"]
    assert (res / "code" / "src" / "eagle3").is_dir()  # the scripts ran from their own copy
