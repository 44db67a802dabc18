"""Export round trip and `check-drafter` against each planted fault of DESIGN.md §6."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from eagle3.cli import main as cli
from eagle3.export import check_drafter, load_drafter, verifier_facts, write_drafter
from eagle3.model import DraftConfig, Eagle3Drafter, KVCache
from tiny_drafter import draft_d2t, make_drafter, one_thread  # noqa: F401 (autouse fixture)

VERIFIER = {"name": "debug", "fingerprint": "0123456789abcdef", "num_layers": 4, "vocab_size": 512, "hidden_size": 64,
            "max_position_embeddings": 2048}


@pytest.fixture
def exported(tmp_path):
    drafter = make_drafter(seed=5)
    with torch.no_grad():  # bf16-representable weights, so the round trip is exact
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    folder = tmp_path / "drafter"
    folder.mkdir()
    write_drafter(drafter, folder, VERIFIER, {"steps": 1})
    return drafter, folder


def edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    save_file(edit(tensors), folder / "model.safetensors")


def edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_round_trip_same_logits(exported):
    drafter, folder = exported
    loaded = load_drafter(folder, drafter.embed_tokens)
    assert loaded.config == drafter.config
    cfg = drafter.config
    aux, ids = torch.randn(1, 6, 3 * cfg.hidden_size), torch.randint(0, cfg.vocab_size, (1, 6))
    a = drafter(ids, drafter.fc(aux), torch.arange(6), KVCache())[0]
    b = loaded(ids, loaded.fc(aux), torch.arange(6), KVCache())[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    sglang = json.loads((folder / "config.sglang.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    tensors = load_file(folder / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert not any("embed" in name for name in tensors)
    assert check_drafter(folder) == []


FAULTS = {
    "layers.0 instead of midlayer": (
        lambda f: edit_tensors(f, lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}), "layers.0.*"),
    "missing lm_head": (lambda f: edit_tensors(f, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}), "missing lm_head.weight"),
    "missing d2t": (lambda f: edit_tensors(f, lambda t: {k: v for k, v in t.items() if k != "d2t"}), "missing d2t"),
    "random embed_tokens": (lambda f: edit_tensors(f, lambda t: {**t, "embed_tokens.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}), "embed_tokens"),
    "d2t outside the vocab": (lambda f: edit_tensors(f, lambda t: {**t, "d2t": t["d2t"] + 200}), "outside the verifier vocab"),
    "fp32 weights": (lambda f: edit_tensors(f, lambda t: {**t, "fc.weight": t["fc.weight"].float()}), "fc.weight is (64, 192) torch.float32"),
    "layer ids in the sglang convention": (
        lambda f: edit_json(f / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])),
        "config.json: eagle_aux_hidden_state_layer_ids [0, 1, 2] != [1, 2, 3]"),
    "sglang config in the vllm convention": (
        lambda f: edit_json(f / "config.sglang.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])),
        "config.sglang.json: eagle_aux_hidden_state_layer_ids [1, 2, 3] != [0, 1, 2]"),
    "too small context": (lambda f: edit_json(f / "config.json", lambda c: c.update(max_position_embeddings=1024)), "max_position_embeddings 1024 <"),
    "taps beyond the verifier": (lambda f: edit_json(f / "meta.json", lambda m: m.update(aux_layers=[1, 2, 4])), "outside the verifier's layers"),
    "not the engine architecture": (lambda f: edit_json(f / "config.json", lambda c: c.update(architectures=["LlamaForCausalLM"])), "architectures"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_check_drafter_catches(exported, fault, capsys):
    _, folder = exported
    plant, message = FAULTS[fault]
    plant(folder)
    problems = check_drafter(folder)
    assert any(message in p for p in problems), problems
    with pytest.raises(SystemExit) as exit_:
        cli(["check-drafter", str(folder)])
    assert exit_.value.code == 1 and message in capsys.readouterr().out


def test_against_real_verifier_folder(tmp_path, tiny_verifier_dir, capsys):
    facts = verifier_facts(tiny_verifier_dir)
    cfg = DraftConfig.from_verifier(AutoConfig.from_pretrained(tiny_verifier_dir), 1024, [1, 2, 3])
    drafter = Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, cfg.draft_vocab_size))
    good, stale = tmp_path / "good", tmp_path / "stale"
    for folder, fingerprint in ((good, facts["fingerprint"]), (stale, "ffffffffffffffff")):
        folder.mkdir()
        write_drafter(drafter, folder, {**facts, "fingerprint": fingerprint}, {})
    assert check_drafter(good, tiny_verifier_dir) == []
    assert any("trained for verifier ffffffffffffffff" in p for p in check_drafter(stale, tiny_verifier_dir))
    (good / "config.sglang.json").unlink()
    cli(["check-drafter", str(good), "--verifier", str(tiny_verifier_dir), "--write-engine-configs", "--engine", "sglang"])
    assert "ok" in capsys.readouterr().out
    assert json.loads((good / "config.sglang.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
