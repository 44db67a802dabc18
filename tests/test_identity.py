"""One verifier, one identity on every machine: the same source imported by another torch (weights
rounded the other way) is another build of the same verifier. Its drafters are accepted with one
line naming both builds, its prompts stay up to date under `dvc status`; other weights are refused."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import yaml
from support.models import import_rounded_the_other_way, round_the_other_way, verifier_model
from support.pipeline import LOCAL_SOURCE, add_dataset, overrides, write_local_prompts
from support.repo import run
from support.speculative import TINY_TAPS, random_drafter

from eagle3.common import UserError, read_json
from eagle3.drafter.export import check_drafter, verifier_facts, write_drafter
from eagle3.lm.identity import architecture, build_difference, tensor_stats
from eagle3.lm.loading import load_verifier, read_meta, verifier_build, verifier_fingerprint
from eagle3.verifier import build_record

SAME_FILES = ("identity.json", "chat_identity.json")  # what must come out byte for byte the same


def reimport(monkeypatch, verifier_dir, out):
    """``verifier_dir``'s source imported again, as another machine's torch rounds it."""
    meta = read_meta(verifier_dir)
    import_rounded_the_other_way(monkeypatch, verifier_model(name=meta["name"], copy_weights=True, source=meta["source"]), out)
    return out


def drafter_for(verifier_dir, out):
    out.mkdir()
    write_drafter(random_drafter(load_verifier(verifier_dir), 512, TINY_TAPS), out, verifier_facts(verifier_dir), {})
    return out


def build_lines(caplog):
    return [r.getMessage() for r in caplog.records if "build" in r.getMessage() and r.levelno >= logging.WARNING]


def test_another_rounding_is_another_build_of_the_same_verifier(monkeypatch, tiny_verifier_dir, tmp_path):
    other = reimport(monkeypatch, tiny_verifier_dir, tmp_path / "other")
    for name in SAME_FILES:
        assert (other / name).read_bytes() == (tiny_verifier_dir / name).read_bytes(), name
    assert verifier_fingerprint(other) == verifier_fingerprint(tiny_verifier_dir)
    here, there = verifier_build(tiny_verifier_dir), verifier_build(other)
    assert here["id"] != there["id"] and here["weights"] != there["weights"]
    assert build_difference(here["tensors"], there["tensors"]) is None


def test_a_drafter_of_another_build_is_accepted_with_one_line_naming_both(monkeypatch, tiny_verifier_dir, tmp_path, caplog):
    other = reimport(monkeypatch, tiny_verifier_dir, tmp_path / "other")
    drafter = drafter_for(tiny_verifier_dir, tmp_path / "drafter")
    with caplog.at_level(logging.WARNING):
        assert check_drafter(drafter, other) == []
    (line,) = build_lines(caplog)
    trained, here = verifier_build(tiny_verifier_dir)["id"], verifier_build(other)["id"]
    assert f"trained with build {trained} " in line and f"this machine's build is {here} " in line
    assert "within one rounding step" in line
    caplog.clear()
    assert check_drafter(drafter, tiny_verifier_dir) == [] and build_lines(caplog) == []  # its own build: nothing said


def test_weights_beyond_rounding_are_refused(tiny_verifier_dir, tmp_path):
    """Twice one rounding step everywhere is not the same weights rounded apart: the drafter is refused."""
    other = tmp_path / "other"
    shutil.copytree(tiny_verifier_dir, other)
    from safetensors.torch import load_file, save_file

    tensors = load_file(other / "model.safetensors")
    save_file({name: t * (1 + 2 ** -21) for name, t in tensors.items()}, other / "model.safetensors")  # 4 fp32 steps
    meta = read_json(other / "meta.json")
    (other / "meta.json").write_text(json.dumps({**meta, "build": build_record(other, other)}))
    drafter = drafter_for(tiny_verifier_dir, tmp_path / "drafter")
    (problem,) = check_drafter(drafter, other)
    assert problem.startswith(f"meta.json: trained with build {verifier_build(tiny_verifier_dir)['id']} of this verifier, whose "
                              f"weights this machine's build {verifier_build(other)['id']} does not match within rounding (tensor ")
    assert "more than one float32 rounding step allows" in problem and problem.endswith("re-import the verifier or retrain")


def test_rounding_bounds_of_the_tensor_statistics(tmp_path):
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    save_file({"w": torch.randn(64, 64).to(torch.bfloat16), "z": torch.zeros(16, dtype=torch.bfloat16)}, tmp_path / "a.safetensors")
    before = tensor_stats(tmp_path)
    round_the_other_way(tmp_path, every=1)  # every element one step away, zeros too
    assert build_difference(before, tensor_stats(tmp_path)) is None
    save_file({"w": torch.randn(64, 64).to(torch.bfloat16), "z": torch.zeros(16, dtype=torch.bfloat16)}, tmp_path / "a.safetensors")
    assert build_difference(before, tensor_stats(tmp_path)).startswith("tensor w's sum")  # other weights
    save_file({"w": torch.zeros(64, 64, dtype=torch.bfloat16)}, tmp_path / "a.safetensors")
    assert build_difference(before, tensor_stats(tmp_path)) == "tensors ['z'] are in one build only"


def test_the_architecture_is_the_same_however_transformers_spells_rope():
    """transformers 4 writes rope_theta and rope_scaling with ``type``; 5, rope_parameters with rope_type."""
    old = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 5e5,
           "rope_scaling": {"type": "llama3", "factor": 8.0}, "transformers_version": "4.57.0"}
    new = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "transformers_version": "5.24.0",
           "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}, "head_dim": 16}
    assert architecture(old) == architecture(new)
    assert architecture({**new, "num_hidden_layers": 3}) != architecture(new)


def test_artifacts_of_an_older_version_are_one_line_to_rerun(tiny_verifier_dir, tmp_path):
    """Older verifier folders had a fingerprint of this machine's bytes, no identity: neither can be derived."""
    old = tmp_path / "old-verifier"
    shutil.copytree(tiny_verifier_dir, old)
    (old / "identity.json").unlink()
    with pytest.raises(UserError, match=r"identity.json: not found: .* was imported before verifiers had an identity; "
                                        r"re-run the verifier stage \(`dvc repro verifier`\)$"):
        verifier_fingerprint(old)
    drafter = drafter_for(tiny_verifier_dir, tmp_path / "drafter")
    meta = read_json(drafter / "meta.json")
    meta["verifier"] = {key: value for key, value in meta["verifier"].items() if key != "build"} | {"fingerprint": "51c7b9e414a4e16c"}
    (drafter / "meta.json").write_text(json.dumps(meta))
    assert check_drafter(drafter, tiny_verifier_dir) == [
        "meta.json: trained for verifier 51c7b9e414a4e16c by an eagle3 from before verifier identities, which this one "
        "cannot compare; retrain it (`dvc repro train`)"]


@pytest.mark.slow
def test_smollm2_reimported_with_other_rounding_is_the_same_verifier(monkeypatch, smollm2_dir, tmp_path, caplog):
    """The packaged GGUF, dequantised again with some bf16 weights rounded the other way."""
    other = reimport(monkeypatch, smollm2_dir, tmp_path / "other")
    for name in SAME_FILES:
        assert (other / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert verifier_build(other)["id"] != verifier_build(smollm2_dir)["id"]
    facts = verifier_facts(smollm2_dir)
    assert facts["fingerprint"] == verifier_fingerprint(other) and facts["build"]["tensors"]["model.norm.weight"][0] == "bfloat16"
    assert build_difference(facts["build"]["tensors"], verifier_build(other)["tensors"]) is None


@pytest.mark.slow
def test_a_reimport_elsewhere_leaves_prompts_up_to_date(make_project, monkeypatch, tmp_path):
    """`dvc repro prompts`, then the verifier stage's output as another machine's torch writes it (committed as
    `dvc repro verifier` there records it): the verifier's bytes changed, `prompts` is up to date."""
    repo = make_project(name="elsewhere")
    add_dataset(repo, {"name": "quick", "shards": ["000000-000004"], **LOCAL_SOURCE})
    write_local_prompts(repo, 12)
    run(["eagle3", "params", *overrides("model=tiny-random", "dataset=quick")], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "quick dataset"], repo)
    run(["dvc", "repro", "prompts"], repo)
    verifier_out = verifier_lock_hash(repo)

    model = yaml.safe_load((repo / "params.yaml").read_text())["model"]
    shutil.rmtree(repo / "models" / "verifier")
    reimport_params = verifier_model(**{key: model[key] for key in ("name", "source", "copy_weights", "chat_template")})
    import_rounded_the_other_way(monkeypatch, reimport_params, repo / "models" / "verifier")
    run(["dvc", "commit", "-f", "verifier"], repo)
    assert verifier_lock_hash(repo) != verifier_out  # another build: generate and extract rightly see new weights
    status = run(["dvc", "status", "prompts", "--with-deps"], repo).stdout
    assert "up to date" in status, status


def verifier_lock_hash(repo) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    (out,) = lock["stages"]["verifier"]["outs"]
    return out["md5"]
