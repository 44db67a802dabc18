"""benchmarks/pipeline_report.py reads a run folder of benchmarks/offline/pipeline_run.sh: stage windows from
DVC's timestamped lines, GPU busy share from the sampler's file, training's tokens/s and τ per set from the
stages' own metrics; --poll and --readme-table show the same. The whole run on the CPU (the demo, a few
minutes) runs on request: EAGLE3_PIPELINE_SMOKE=1 pytest tests/test_pipeline_report.py -k smoke.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.repo import ROOT

REPORT = ROOT / "benchmarks" / "pipeline_report.py"
T0 = 1_700_000_000.0  # in the past: a running window lasts until now

# (seconds after T0, line): one job, as pipeline_run.sh's stamp.py writes DVC's output
LOG = [
    (0, "=== session start pid 7"), (0.5, "Running stage 'params':"), (1, "Updating lock file 'dvc.lock'"),
    (1, "Running stage 'verifier':"), (30, "Updating lock file 'dvc.lock'"), (30, "=== dvc repro verifier: exit 0"),
    (31, "=== prompts committed"),
    (32, "Stage 'params' didn't change, skipping"), (32, "Stage 'verifier' didn't change, skipping"),
    (32, "Stage 'prompts' didn't change, skipping"),
    (32, "Running stage 'generate@000000-000032':"), (40, "Updating lock file 'dvc.lock'"),
    (40, "Running stage 'generate@000032-001000':"), (50, "12:00:00 INFO slots: 1000 requests"), (52, "Updating lock file 'dvc.lock'"),
    (52, "Running stage 'extract@000000-000032':"), (60, "Updating lock file 'dvc.lock'"),
    (60, "Running stage 'extract@000032-001000':"), (70, "Updating lock file 'dvc.lock'"),
    (70, "Running stage 'train':"), (120, "12:00:50 INFO eagle3.training.reporting: step 10 loss 9.1 acc_0 0.1"),
    (120, "12:00:50 INFO eagle3.training.reporting: step 20 loss 8.1 acc_0 0.2"),
    (165, "12:01:35 INFO eagle3.training.reporting: step 60 loss 4.1 acc_0 0.6"),
    (169, "12:01:39 INFO eagle3.training.loop: fit's wall time: 98.0 s; setting up the step 0.1 s (0%), "
          "the first step (compiling) 4.6 s (5%), queueing steps 90.0 s (92%)"),
    (169, "12:01:39 INFO eagle3.training.loop: compiled graphs: AOT autograd cache 2 hits, 0 misses, 0 bypassed; "
          "FX graph cache 4 hits, 0 misses, 0 bypassed"), (170, "Updating lock file 'dvc.lock'"),
    (170, "Running stage 'evaluate':"), (200, "Updating lock file 'dvc.lock'"),
    (200, "Running stage 'summary':"), (201, "Updating lock file 'dvc.lock'"), (202, "=== exit 0"),
]


def synthetic_run(folder: Path, lines=LOG, utilisation=lambda t: 50.0) -> Path:
    """A run folder as pipeline_run.sh leaves it, with a sample every second from T0 to T0 + 202."""
    (folder / "logs").mkdir(parents=True)
    (folder / "logs/dvc.log").write_text("".join(f"{T0 + t:.3f}\t{text}\n" for t, text in lines))
    samples = "".join(f"{T0 + t:.3f}\t{utilisation(t):.1f}\t1024\n" for t in range(203))
    (folder / "logs/gpu.tsv").write_text(f"# gpu: NVIDIA H200 x1\nt\tutil\tmem_mib\n{samples}")
    (folder / "dvclive/train/plots/metrics/train").mkdir(parents=True)
    (folder / "dvclive/train/metrics.json").write_text(json.dumps({"train": {"tokens_per_s": 9000.0}, "tokens_trained": 500_000, "step": 60}))
    (folder / "dvclive/train/plots/metrics/train/tokens_per_s.tsv").write_text("step\ttokens_per_s\n1\t1000\n2\t6000\n3\t7000\n")
    (folder / "dvclive/evaluate").mkdir(parents=True)
    sets = {name: {"prompts": prompts, "tau": tau, "tree": {"tau": tau + 0.5}, "ngram": {"tau": 1.5}, "baseline": {"tau": 1.1}}
            for name, prompts, tau in (("heldout", 200, 3.2), ("humaneval", 164, 1.87))}
    sets["heldout"]["outside_draft_vocab"] = 0.0123  # humaneval's as a record before the metric existed
    (folder / "dvclive/evaluate/metrics.json").write_text(json.dumps({**sets, "wall_seconds": 30.0}))
    (folder / "params.yaml").write_text("evaluate:\n  max_new_tokens: 256\n")
    return folder


def report(*args: str) -> str:
    return subprocess.run([sys.executable, str(REPORT), *map(str, args)], capture_output=True, text=True, check=True).stdout


def test_the_report_times_each_stage_and_reads_the_stages_metrics(tmp_path):
    busy_in_train = lambda t: 80.0 if 70 <= t < 170 else 10.0  # noqa: E731
    run = synthetic_run(tmp_path / "run", utilisation=busy_in_train)
    (tmp_path / "peer.json").write_text(json.dumps({"tokens": 300_000, "seconds": 60.0, "steps": 40, "step_median_seconds": 1.25}))
    out = tmp_path / "pipeline.json"
    report(run, "--out", out, "--commit", "abc1234", "--command", "dvc repro", "--peer", tmp_path / "peer.json")
    result = json.loads(out.read_text())
    assert (result["commit"], result["command"], result["gpu"], result["finished"]) == ("abc1234", "dvc repro", "NVIDIA H200 x1", True)
    assert result["total_wall_s"] == 202.0
    assert list(result["stages"]) == ["params", "verifier", "generate", "extract", "train", "evaluate", "summary"]
    assert result["stages"]["verifier"] == {"wall_s": 29.0, "gpu_busy": 0.1}
    assert result["stages"]["train"] == {"wall_s": 100.0, "gpu_busy": 0.8}
    generate = result["stages"]["generate"]  # a group: its items summed, and each
    assert generate["wall_s"] == 20.0 and generate["gpu_busy"] == 0.1
    assert generate["items"] == {"000000-000032": {"wall_s": 8.0, "gpu_busy": 0.1}, "000032-001000": {"wall_s": 12.0, "gpu_busy": 0.1}}
    # 40 steps at the run's 500,000 / 60 tokens a step in 45 s
    assert result["train"] == {"tokens_per_s": 5000, "tokens": 500_000, "steps": 60, "logged_tokens_per_s": 6000,
                               "after_first_sync": {"wall_s": 45.0, "steps": 40, "gpu_busy": 0.8, "tokens_per_s": 7407},
                               "first_step_s": 4.6, "compiled_graphs": "AOT autograd cache 2 hits, 0 misses, 0 bypassed; "
                               "FX graph cache 4 hits, 0 misses, 0 bypassed"}
    # the peer at its median step: 7,500 tokens a step in 1.25 s; over its wall 5,000
    assert result["peer"] == {"tokens_per_s": 6000, "whole_run_tokens_per_s": 5000, "tokens": 300_000, "steps": 40,
                              "seconds": 60.0, "step_median_s": 1.25, "source": "peer.json"}
    assert result["train_over_peer"] == {"steady": 1.23, "whole_run": 0.83}
    headline = report("--readme-results", out)
    assert "The peer trainer (`peer.json`): 6.0k tokens/s at its median step over 40 steps; ours 0.83× that over train's whole wall, 1.23× after" in headline
    assert "Answer tokens outside the draft vocabulary (each ends a chain): `heldout` 1.2 %." in headline
    assert result["sets"] == {
        "heldout": {"prompts": 200, "max_new_tokens": 256, "tau": 3.2, "tree_tau": 3.7, "ngram_tau": 1.5, "outside_draft_vocab": 0.0123},
        "humaneval": {"prompts": 164, "max_new_tokens": 256, "tau": 1.87, "tree_tau": 2.37, "ngram_tau": 1.5}}


def test_without_nvml_or_peer_the_shares_and_the_peer_are_null(tmp_path):
    run = synthetic_run(tmp_path / "run")
    (run / "logs/gpu.tsv").write_text("# no NVML: NVMLError_LibraryNotFound: NVML Shared Library Not Found\n")
    result = json.loads(report(run))
    assert result["gpu"] is None and result["gpu_busy"] is None
    assert all(stage["gpu_busy"] is None for stage in result["stages"].values())
    assert result["peer"] == {"tokens_per_s": None} and result["train_over_peer"] is None


def test_a_resumed_job_sums_its_sessions_and_a_peer_tau_json_gives_its_longest_peer_run(tmp_path):
    killed = [(0, "=== session start pid 7"), (1, "Running stage 'train':"), (41, "step 100 loss 3.2")]  # no exit line
    resumed = [(100, "=== session start pid 9"), (101, "Stage 'merge' didn't change, skipping"), (101, "Running stage 'train':"),
               (161, "Updating lock file 'dvc.lock'"), (162, "=== exit 0")]
    run = synthetic_run(tmp_path / "run", lines=killed + resumed)
    peer = {"runs": [{"trainer": "eagle3", "tokens": 1, "train_seconds": 1.0},
                     {"trainer": "speculators 0.9.0", "tokens": 200_000, "train_seconds": 20.0},
                     {"trainer": "speculators 0.9.0", "tokens": 900_000, "train_seconds": 100.0, "steps": 90,
                      "step_median_seconds": None}]}
    (tmp_path / "peer_tau.json").write_text(json.dumps(peer))
    result = json.loads(report(run, "--peer", tmp_path / "peer_tau.json"))
    assert result["total_wall_s"] == 41.0 + 62.0
    assert result["stages"]["train"]["wall_s"] == 40.0 + 61.0
    assert result["peer"]["tokens_per_s"] == 9000  # no step time: over its wall


def test_poll_shows_the_running_stage_and_the_last_lines(tmp_path):
    running = [line for line in LOG if line[0] <= 50]
    run = synthetic_run(tmp_path / "run", lines=running)
    screen = report(run, "--poll")
    assert ": running, " in screen.splitlines()[0]
    assert "now: generate@000032-001000" in screen
    assert "| 12:00:00 INFO slots: 1000 requests" in screen
    partial = json.loads(report(run))
    assert partial["finished"] is False and partial["stages"]["generate"]["wall_s"] > 8.0


def test_the_readme_table_lists_each_stage_and_the_whole_run(tmp_path):
    run = synthetic_run(tmp_path / "run")
    report(run, "--out", tmp_path / "pipeline.json")
    table = report("--readme-table", tmp_path / "pipeline.json").splitlines()
    assert table[:3] == ["| stage | wall | GPU busy |", "|---|---|---|", "| `params` | 0 s | – |"]  # no sample in its half second
    assert "| `generate` ×2 | 20 s | 50 % |" in table
    assert table[-1] == "| whole run | 202 s | 50 % |"


BLOCKED = """import sys
class Refuse:  # the offline kit leaves these out (benchmarks/offline/kit.sh): a run must not import them
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"pygit2", "asyncssh", "cryptography"}:
            raise ImportError(f"{name}: not in the offline kit")
sys.meta_path.insert(0, Refuse())
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EAGLE3_PIPELINE_SMOKE"), reason="minutes of CPU: EAGLE3_PIPELINE_SMOKE=1 runs it")
def test_smoke_the_whole_demo_run_detached_then_reported(tmp_path):
    """pipeline_run.sh on the demo with carried prompts, without the packages the kit leaves out, the peer's rate asked
    for (its wheels absent here: that step fails in its log and the job goes on), and one variant on its cache (only
    what the variant changes runs); then the reports, as pipeline_wait.sh brings them back."""
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked/sitecustomize.py").write_text(BLOCKED)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "blocked"), "OVERRIDES": "-S dataset=demo -S layout=cpu",
           "PYTHON": sys.executable, "SAMPLE_EVERY": "0.5", "VARIANTS": "-S train.max_steps=4", "COMMIT": "smoke",
           "PEER_RATE": "1", "PEER_STEPS": "20"}
    prompts, run = tmp_path / "prompts.tar.gz", tmp_path / "run"
    subprocess.run(["bash", ROOT / "benchmarks/offline/prompts_tar.sh", prompts, "-S", "dataset=demo", "-S", "layout=cpu"],
                   env=env, check=True, capture_output=True)
    started = subprocess.run(["bash", ROOT / "benchmarks/offline/pipeline_run.sh", run, prompts], env=env, check=True,
                             capture_output=True, text=True).stdout
    assert "started: job" in started
    again = subprocess.run(["bash", ROOT / "benchmarks/offline/pipeline_run.sh", run, prompts], env=env, check=True,
                           capture_output=True, text=True).stdout
    assert again.startswith("running: job")  # a second call while it runs only says so
    deadline = time.time() + 1800  # about 12 min on two busy cores
    while not (run / "logs/job.rc").is_file() and time.time() < deadline:
        time.sleep(5)
    log = (run / "logs/dvc.log").read_text()
    assert (run / "logs/job.rc").read_text().strip() == "0", log[-3000:]
    assert "Running stage 'prompts'" not in log and "Stage 'prompts' didn't change, skipping" in log
    assert "=== peer rate: failed (logs/peer_tau.log)" in log and (run / "logs/peer_rate.wanted").read_text().strip() == "20"
    assert "the peer's packages" in (run / "logs/peer_tau.log").read_text()
    result = json.loads(report(run, "--commit", "smoke"))
    assert result["finished"] and result["gpu"] is None
    assert {"verifier", "generate", "extract", "merge", "train", "evaluate", "summary"} <= result["stages"].keys()
    assert result["train"]["tokens_per_s"] > 0
    assert set(result["sets"]) == {"heldout", "humaneval", "math"}
    assert result["sets"]["heldout"]["prompts"] == 4
    variant = run / "variants/1"
    assert (variant / "logs/pipeline.rc").read_text().strip() == "0"
    log = (variant / "logs/dvc.log").read_text()
    assert "Running stage 'train'" in log and "Running stage 'generate" not in log and "Running stage 'extract" not in log
    assert "train.max_steps=4" in (variant / "logs/command.txt").read_text()
    out = tmp_path / "out"
    subprocess.run(["bash", ROOT / "benchmarks/offline/pipeline_wait.sh", run, "0", out], env=env, check=True, capture_output=True)
    assert json.loads((out / "pipeline_10k.json").read_text())["commit"] == "smoke"
    subprocess.run(["tar", "-xzf", out / "variants.tar.gz", "-C", out], check=True)
    assert json.loads((out / "variants/1/pipeline_10k.json").read_text())["finished"]
    done = subprocess.run(["bash", ROOT / "benchmarks/offline/pipeline_run.sh", run, prompts], env=env, check=True,
                          capture_output=True, text=True).stdout
    assert done.startswith("done:")


def test_an_unfinished_evaluate_reports_the_sets_it_logged_and_ends_at_its_last_record(tmp_path):
    """evaluate writes its metrics at its end: a run stopped inside it has only its lines for the sets done;
    its open window ends at the newest record, so the report rebuilt later from the logs reads the same."""
    done = ("12:00:00 INFO eagle3.decoding.evaluation: heldout: chain tau 3.386, speedup 0.86x at batch 1; tree tau 3.85; "
            "baselines tau 1.05 (most frequent), 3.25 (ngram); 200 prompts in 204.6 s")
    lines = [line for line in LOG if line[0] <= 170] + [(190, done)]
    run = synthetic_run(tmp_path / "run", lines=lines)
    (run / "dvclive/evaluate/metrics.json").unlink()
    result = json.loads(report(run))
    assert result["finished"] is False
    assert result["sets"] == {"heldout": {"prompts": 200, "max_new_tokens": 256, "tau": 3.386, "tree_tau": 3.85,
                                          "ngram_tau": 3.25, "from": "log"}}
    assert result["stages"]["evaluate"]["wall_s"] == 32.0  # 170 to the last sample at 202, not to the clock
    (run / "dvclive/evaluate/metrics.json").write_text(json.dumps({"heldout": {"prompts": 200, "tau": 9.0}}))
    assert json.loads(report(run))["sets"] == result["sets"]  # a variant's copy of the first run's metrics is not its own
