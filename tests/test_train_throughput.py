"""benchmarks/train_throughput.py runs against the library as it is: its smoke mode (a tiny drafter on the CPU)."""

from __future__ import annotations

import json
import math
import pstats
import subprocess
import sys

from support.repo import ROOT, project_params


def test_the_train_benchmark_smoke_mode_writes_its_figures(tmp_path):
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--smoke", "--profile-first-step", "5",
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    record = json.loads(out.read_text())
    assert set(record) == {"commit", "command", "figures"} and "--smoke" in record["command"]
    figures = record["figures"]
    assert figures["shape"]["recipe"] == "debug" and figures["shape"]["targets_per_step"] > 0
    eager = figures["modes"]["eager"]
    assert "error" not in eager, eager
    assert eager["median_step_s"] > 0 and eager["tokens_per_s"] > 0 and eager["gpu_util"] is None
    assert len(eager["losses"]) == 2 and all(math.isfinite(loss) for loss in eager["losses"])
    profile = eager["first_step_profile"]  # the first step's heaviest functions, by their own time and with callees
    assert [len(profile["own"]), len(profile["with_callees"])] == [5, 5]
    seconds, calls, where = profile["with_callees"][0]
    assert seconds > 0 and calls >= 1 and "(" in where and "compile_timers" not in eager  # eager: nothing compiled
    assert pstats.Stats(str(tmp_path / "figures.eager.prof")).total_tt > 0  # the whole profile, beside the figures


def test_rows_held_on_the_device_take_the_loaders_losses(tmp_path):
    """--states-on-device gathers the rows the stage's loader reads from disk: the same first losses; --validate times
    two validations of the val split."""
    losses = {}
    for flags in ([], ["--states-on-device"]):
        out = tmp_path / f"figures{len(flags)}.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "--smoke", "--loader-workers", "0",
                        "--validate", *flags, "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
        figures = json.loads(out.read_text())["figures"]
        losses[bool(flags)] = figures["modes"]["eager"]["losses"]
        validation = figures["modes"]["eager"]["validation"]
        assert len(validation["seconds"]) == 2 and validation["graphs_before"] == validation["graphs_after"] == 0
    assert figures["shape"]["data"] == "random, the stage's format, held on the device, through 0 loader workers"
    assert losses[True] == losses[False]


def test_the_drafter_and_recipe_can_come_from_a_verifier_and_a_project(tmp_path, tiny_verifier_dir):
    """--verifier with --params: the drafter train builds for that verifier (its hidden size and vocabulary, the
    project's draft vocabulary) and the project's own train section, not a preset and a conf/ recipe; either alone is
    refused."""
    out, script = tmp_path / "figures.json", str(ROOT / "benchmarks" / "train_throughput.py")
    subprocess.run([sys.executable, script, "--smoke", "--verifier", str(tiny_verifier_dir), "--params", str(ROOT / "params.yaml"),
                    "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    shape = json.loads(out.read_text())["figures"]["shape"]
    config, params = json.loads((tiny_verifier_dir / "config.json").read_text()), project_params()
    assert (shape["H"], shape["V"], shape["preset"]) == (config["hidden_size"], config["vocab_size"], str(tiny_verifier_dir))
    assert (shape["Vd"], shape["recipe"]) == (params.merge.draft_vocab_size, params.train.name)
    alone = subprocess.run([sys.executable, script, "--smoke", "--verifier", str(tiny_verifier_dir), "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "--verifier and --params go together" in alone.stderr
