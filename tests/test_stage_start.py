"""benchmarks/stage_start.py, whose CUDA run measures a per-shard process's start on the GPU host: its CPU
smoke run times every phase in fresh processes and finds the same first forward for both load paths."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stage_start_smoke_times_every_phase_with_the_same_outputs(tmp_path):
    out = tmp_path / "start.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/stage_start.py"), str(out), "--smoke"], check=True,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert {"commit", "command", "device", "versions", "verifier", "runs", "median"} <= result.keys()
    assert [run["method"] for run in result["runs"]] == ["transformers", "eagle3"]
    for phases in result["median"].values():
        assert {"import_torch", "import_stage", "device_start", "load", "forward_1", "forward_2", "decode_1", "decode_2",
                "process_s"} <= phases.keys()
        assert all(seconds >= 0 for seconds in phases.values())
    assert result["same_outputs"]
