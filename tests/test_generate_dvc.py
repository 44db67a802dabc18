"""Stage ``generate`` under real ``dvc repro``: SIGKILL mid-shard, rerun, and the shard resumes from
the journal into exactly the bytes of an uninterrupted run."""

from __future__ import annotations

import shutil

import pytest
from support.processes import kill_when, start_repro
from support.repo import run
from omegaconf import OmegaConf
from support.generate import output_bytes, prompt

from eagle3.common import write_jsonl
from eagle3.generate import run_stage
from eagle3.lm.loading import load_tokenizer


@pytest.mark.slow
def test_sigkill_mid_shard_then_dvc_repro_resumes_byte_identical(make_project, tiny_verifier_dir, tmp_path):
    repo = make_project("generate.max_new_tokens=16", "backend.batch_size=1", "layout.threads=1")
    params = OmegaConf.load(repo / "params.yaml")
    shard = params.dataset.shards[0]
    shutil.copytree(tiny_verifier_dir, repo / "models" / "verifier")
    questions = [f"Question {i}: what is {i} + {i}?" for i in range(6)]
    prompts = repo / "data" / "prompts" / "shards" / f"{shard}.jsonl"  # as the prompts stage writes it
    prompts.parent.mkdir(parents=True)
    tokenizer = load_tokenizer(tiny_verifier_dir)
    write_jsonl(prompts, [prompt(tokenizer, q) for q in questions])
    journal_dir = repo / ".eagle3" / "journal" / "generate"
    stage = f"generate@{shard}"

    killed = start_repro(repo, "-s", stage)
    kill_when(killed, lambda: journaled(journal_dir) >= 2, timeout=120)  # SIGKILL of dvc and the stage process
    before = journaled(journal_dir)
    assert 2 <= before < len(questions) and not (repo / "data" / "generated" / shard).exists()

    resumed = run(["dvc", "repro", "-s", stage], repo)
    assert f"resuming with {before} of {len(questions)} answers journaled" in resumed.stderr
    assert "Data and pipelines are up to date" in run(["dvc", "status", stage], repo).stdout

    reference = tmp_path / "reference"
    run_stage(repo / "models" / "verifier", prompts, reference, params, tmp_path / "journal", None)
    assert output_bytes(repo / "data" / "generated" / shard) == output_bytes(reference)


def journaled(journal_dir) -> int:
    return sum(f.read_bytes().count(b"\n") for f in journal_dir.glob("*.jsonl")) if journal_dir.is_dir() else 0
