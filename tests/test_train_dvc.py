"""Hidden states damaged after extraction are refused by ``train`` before it trains: a real
``dvc repro -f -s train`` of the project's extract, merge and train stages in a temporary repository."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from support.merge import SHARDS, make_repo
from support.repo import ROOT, run
from support.train import part_element


def train_outs(repo: Path) -> list[dict]:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train"]["outs"]


# What every refusal of `dvc repro -s train` ends with: DVC removed train's outputs before the stage refused.
RESTORE_TRAIN = ("DVC removed train's outputs before running it: `dvc checkout train` brings back the recorded ones, "
                 "`git checkout dvclive/train` the uncached ones")


@pytest.mark.slow
def test_an_in_range_flip_of_a_hidden_state_is_refused_before_training(tmp_path, tiny_verifier_dir, tiny_model_params):
    repo = make_repo(tmp_path, tiny_verifier_dir, tiny_model_params, stages=("extract", "merge", "train"))
    params = OmegaConf.load(repo / "params.yaml")
    params.train = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "train" / "debug.yaml"), {"max_steps": 2})
    OmegaConf.save(params, repo / "params.yaml")
    run(["dvc", "repro"], repo)
    recorded = train_outs(repo)

    # One aux byte changed, the value still finite and within the magnitudes the index records
    # (the lowest mantissa bit). The file is replaced, not written through its cache hardlink.
    shard = repo / "data" / "hidden_states" / SHARDS[0]
    part = sorted(shard.glob("part-*.safetensors"))[0]
    damaged = bytearray(part.read_bytes())
    at = next(a for a in (part_element(part, "aux", i) for i in range(64)) if damaged[a] & 1)
    damaged[at] ^= 1
    part.unlink()
    part.write_bytes(bytes(damaged))

    refused = run(["dvc", "repro", "-f", "-s", "train"], repo, check=False)
    assert refused.returncode != 0
    (line,) = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: data/hidden_states/{SHARDS[0]}/{part.name} has sha256 "), line
    assert (f"re-extract it (`dvc repro -f extract@{SHARDS[0]}`) or restore it "
            f"(`dvc checkout --force data/hidden_states/{SHARDS[0]}`); " + RESTORE_TRAIN) in line, line
    assert train_outs(repo) == recorded  # dvc.lock never records a drafter trained on the damage

    run(["dvc", "checkout", "--force", f"data/hidden_states/{SHARDS[0]}"], repo)  # what the line says restores it
    run(["dvc", "repro", "-f", "-s", "train"], repo)
    assert train_outs(repo) == recorded  # the same drafter as before the damage

    # Written in place through the cache's hard link (as root does, whatever the mode): the cache object is damaged
    # too, so `dvc checkout` cannot restore it; the line names the object and the mend that works.
    part.chmod(0o644)
    with part.open("r+b") as handle:
        handle.seek(at)
        handle.write(bytes([damaged[at]]))
    twin = next(path for path in (repo / ".dvc" / "cache" / "files" / "md5").glob("*/*") if path.samefile(part))
    refused = run(["dvc", "repro", "-f", "-s", "train"], repo, check=False)
    (line,) = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
    folder, twin = f"data/hidden_states/{SHARDS[0]}", twin.relative_to(repo)
    assert f"its DVC cache object {twin} is the same file" in line and "as root a write ignores" in line, line
    assert (f"remove both (`rm -f {folder}/{part.name} {twin}`), then re-extract (`dvc repro -f extract@{SHARDS[0]}`) "
            f"or pull a copy pushed before the damage (`dvc pull --force {folder}`); " + RESTORE_TRAIN) in line, line
    run(["rm", "-f", f"{folder}/{part.name}", str(twin)], repo)
    run(["dvc", "repro", "-f", f"extract@{SHARDS[0]}"], repo)
    run(["dvc", "repro", "-f", "-s", "train"], repo)
    assert train_outs(repo) == recorded
