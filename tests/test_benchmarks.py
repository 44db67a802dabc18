"""Every benchmarks/*.py runs against the library as it is: each script's CPU smoke mode in a fresh interpreter
(tiny random-weight models, seconds), from a temporary folder, so a change in src/ that a benchmark no longer
fits fails here rather than at its next GPU lease. The smoke modes are what docs/benchmarks.md names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3.drafter.export import verifier_facts, write_drafter
from eagle3.lm.loading import load_verifier
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from support.models import tiny_model_spec
from support.repo import ROOT, project_params, with_sources
from support.speculative import QUESTIONS, TINY_TAPS, random_drafter

BENCHMARKS = ROOT / "benchmarks"
# A script's smoke command after ``python benchmarks/<script>``, run in a folder holding params.yaml (the demo's,
# on the tiny verifier: tiny_params); "{verifier}" is the tiny verifier, "{out}" a JSON file beside that folder;
# with "{demo}" (that folder) it also holds a finished demo's models/ and data/prompts (tiny_demo).
SMOKE = {
    "decode_attention.py": ["--smoke", "--json", "{out}"],
    "evaluate_stage.py": ["{demo}"],
    "extract_throughput.py": ["{verifier}", "--smoke"],
    "generate_throughput.py": ["--smoke", "--json", "{out}"],
    "loader_throughput.py": ["--smoke", "--out", "{out}"],
    "peer_speculators.py": ["--smoke"],  # without speculators installed: this project's side of the step only
    "peer_tau.py": ["--help"],  # a pipeline run and the peer's trainer: its imports (ours, peer_format's) only
    "peer_train.py": ["--help"],  # the peer's own trainer, nothing of ours: its imports only
    "pipeline_report.py": ["--readme-table", str(BENCHMARKS / "results" / "pipeline_10k.json")],
    "tau_vs_data.py": [f"1000={BENCHMARKS / 'results' / 'pipeline_10k_train_prompts1000.json'}",
                       f"7999={BENCHMARKS / 'results' / 'pipeline_10k.json'}", "--out", "{out}"],
    "recipe_sweep.py": ["--params", "{demo}/params.yaml", "--work", "{demo}/sweep", "--json", "{out}", "--device", "cpu",
                        "--only", "b768-lr3e-4-e1-pack_tokens768-micro_batch_rows1-datashort",  # rows the demo's pack_tokens fits
                        "--parallel", "1", "--threads", "1", "--set", "train.max_steps=1",
                        "merge.min_tokens=1"],  # the tiny random verifier's answers are a token or two
    "sharded_extract.py": ["{verifier}", "--smoke"],  # under torchrun: two CPU processes (gloo)
    "storage_throughput.py": ["--smoke"],
    "part_writer.py": ["{out}", "--smoke", "--parts", "1", "--repeats", "1"],
    "baselines_replay.py": ["{out}", "--smoke"],
}
TORCHRUN = {"sharded_extract.py"}
# Smoke runs that have a test of their own, which checks their output too.
TESTED_ELSEWHERE = {
    "evaluate_throughput.py": "tests/test_evaluate.py::test_throughput_benchmark_runs_on_the_cpu_with_a_tiny_shape",
    "generate_vllm.py": "tests/test_generate_vllm.py::test_generate_through_a_started_server_is_compared_with_the_local_answers",
    "serve_vllm.py": "tests/test_serve_vllm.py::test_without_vllm_the_script_says_so_in_one_line_and_keeps_the_results",
    "stage_start.py": "tests/test_stage_start.py::test_stage_start_smoke_times_every_phase_with_the_same_outputs",
    "train_throughput.py": "tests/test_train_throughput.py::test_the_train_benchmark_smoke_mode_writes_its_figures",
}
# Modules the scripts import, run through the script named.
LIBRARIES = {"common.py": "generate_throughput.py", "shapes.py": "train_throughput.py", "peer_format.py": "peer_tau.py"}


def test_every_benchmark_script_has_a_smoke_run():
    scripts = sorted(path.name for path in BENCHMARKS.glob("*.py"))
    assert scripts == sorted({*SMOKE, *TESTED_ELSEWHERE, *LIBRARIES}), "give a new benchmark a smoke mode and list it here"
    assert all(LIBRARIES[name] in {*SMOKE, *TESTED_ELSEWHERE} for name in LIBRARIES)


@pytest.mark.parametrize("script", sorted(TESTED_ELSEWHERE))
def test_a_smoke_run_tested_elsewhere_is_there(script):
    path, _, test = TESTED_ELSEWHERE[script].partition("::")
    source = (ROOT / path).read_text()
    assert f"def {test}(" in source and script in source


def tiny_params():
    """The demo's params on the tiny verifier, every measurement cut to a few tokens once."""
    params = project_params()
    params.model = tiny_model_spec()
    params.generate.max_new_tokens = 8
    params.evaluate.merge_with({"max_new_tokens": 8, "sets": ["heldout"], "batch_sizes": [2], "repeats": 1, "timed_prompts": None,
                                "timed_new_tokens": None, "baseline": False, "tree": {"num_steps": 2, "topk": 2, "num_draft_tokens": 4}})
    params.layout.threads = 1
    return params


def tiny_demo(folder: Path, verifier: Path) -> None:
    """What the stages after ``prompts`` read in a demo, of the tiny verifier: models/verifier, a random drafter of it
    in models/drafter, and data/prompts with two prompts in its shard and in its one eval set."""
    (folder / "models").mkdir()
    (folder / "models" / "verifier").symlink_to(verifier)
    drafter = folder / "models" / "drafter"
    drafter.mkdir()
    write_drafter(random_drafter(load_verifier(verifier), 512, TINY_TAPS), drafter, verifier_facts(verifier), {})
    prompts = folder / "data" / "prompts"
    (prompts / "eval").mkdir(parents=True)
    (prompts / "shards").mkdir()
    (prompts / "meta.json").write_text(json.dumps({"tokenizer": tokenizer_fingerprint(verifier)}))
    chats = "".join(json.dumps({"id": f"{i:016x}", "source": "tests", "messages": [{"role": "user", "content": question}]}) + "\n"
                    for i, question in enumerate(QUESTIONS[:2]))
    (prompts / "eval" / "heldout.jsonl").write_text(chats)
    for shard in project_params().dataset.shards:
        (prompts / "shards" / f"{shard}.jsonl").write_text(chats)


def smoke_command(script: str, work: Path, verifier: Path) -> list[str]:
    arguments = [a.format(verifier=verifier, out=work.parent / "out.json", demo=work) for a in SMOKE[script]]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"] if script in TORCHRUN else [sys.executable]
    return [*launcher, str(BENCHMARKS / script), *arguments]


def failures(record) -> list:
    """The ``error`` entries anywhere in a benchmark's JSON: where a part, mode or run that failed is recorded."""
    if isinstance(record, dict):
        return [record[key] for key in record if key == "error"] + [e for value in record.values() for e in failures(value)]
    return [e for value in record for e in failures(value)] if isinstance(record, list) else []


def changed_files() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_benchmark_smoke_mode_runs(script, tmp_path, tiny_verifier_dir):
    """The smoke command exits 0, records no failed part and writes only into its temporary folder (and temporary files)."""
    work = tmp_path / "work"
    work.mkdir()
    OmegaConf.save(tiny_params(), work / "params.yaml")
    if any("{demo}" in argument for argument in SMOKE[script]):
        tiny_demo(work, tiny_verifier_dir)
    env = with_sources(PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]), DVC_NO_ANALYTICS="1")
    before = changed_files()
    done = subprocess.run(smoke_command(script, work, tiny_verifier_dir), cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert changed_files() == before
    if "{out}" in SMOKE[script]:
        record = json.loads((tmp_path / "out.json").read_text())
        assert record and not failures(record)


def test_a_named_commit_wins_over_the_checkouts(monkeypatch):
    """EAGLE3_COMMIT names the code a lease ran (its copy of the tree may carry an older commit's git metadata)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from common import commit

    monkeypatch.setenv("EAGLE3_COMMIT", "abc1234")
    assert commit() == "abc1234"
    monkeypatch.delenv("EAGLE3_COMMIT")
    assert commit() != "abc1234"
