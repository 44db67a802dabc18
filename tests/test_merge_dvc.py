"""Scaling the dataset re-extracts only the new shards: a real ``dvc repro`` of the project's own
extract and merge stage blocks, in a temporary git repository, with the tiny verifier."""

from __future__ import annotations

import pytest
import yaml

from eagle3.common import read_jsonl

from support.merge import SHARDS, make_repo, plant_leftover, run, write_params


@pytest.mark.slow
def test_second_shard_is_the_only_one_extracted(tmp_path, tiny_verifier_dir, tiny_model_params):
    repo = make_repo(tmp_path, tiny_verifier_dir, tiny_model_params)
    first = run(repo, "dvc", "repro")
    assert f"Running stage 'extract@{SHARDS[0]}'" in first and "Running stage 'merge'" in first
    part = next((repo / "data" / "hidden_states" / SHARDS[0]).glob("part-*.safetensors"))
    before = part.stat().st_ino, part.stat().st_mtime_ns

    write_params(repo, tiny_model_params, SHARDS)
    second = run(repo, "dvc", "repro")
    assert f"Running stage 'extract@{SHARDS[1]}'" in second and "Running stage 'merge'" in second
    assert f"Running stage 'extract@{SHARDS[0]}'" not in second
    assert (part.stat().st_ino, part.stat().st_mtime_ns) == before
    rows = list(read_jsonl(repo / "data" / "merged" / "manifest.jsonl"))
    assert {row["shard"] for row in rows} == set(SHARDS) and len(rows) == 8

    # merge's statistics are a plain output now (the summary stage holds the DVC metrics)
    assert "vocab_coverage" in (repo / "metrics" / "merge" / "metrics.json").read_text()
    assert "up to date" in run(repo, "dvc", "status")


@pytest.mark.slow
def test_a_killed_extracts_leftover_never_enters_a_hash(tmp_path, tiny_verifier_dir, tiny_model_params):
    repo = make_repo(tmp_path, tiny_verifier_dir, tiny_model_params)
    hidden = repo / "data" / "hidden_states"
    rerun = plant_leftover(hidden / SHARDS[0])  # its shard is extracted again: deleted before writing
    other = plant_leftover(hidden / SHARDS[1])  # a shard the params do not list: stays, ignored
    run(repo, "dvc", "repro")
    assert not rerun.exists() and other.exists()
    merge_dep = next(d for d in yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["merge"]["deps"]
                     if d["path"] == "data/hidden_states")
    assert merge_dep["nfiles"] == sum(1 for p in hidden.rglob("*") if p.is_file() and ".tmp-" not in str(p))
    assert "up to date" in run(repo, "dvc", "status")
    plant_leftover(hidden / SHARDS[0])  # after the run, e.g. a kill of a `dvc repro -f`
    assert "up to date" in run(repo, "dvc", "status")
    assert ".tmp-" not in run(repo, "git", "status", "--porcelain", "--untracked-files=all")
