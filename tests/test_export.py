"""Export round trip and `check-drafter` against each planted fault of docs/design.md §2."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from eagle3.cli import main as cli
from eagle3.drafter.export import (
    ENGINE_TAPS,
    check_drafter,
    default_taps,
    load_drafter,
    sglang_taps,
    verifier_facts,
    vllm_taps,
    write_drafter,
)
from eagle3.drafter.attention import KVCache
from eagle3.drafter.tools import speculators_command
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from support.tiny_drafter import draft_d2t, make_drafter, one_thread  # noqa: F401 (autouse fixture)

VERIFIER = {"name": "debug", "fingerprint": "0123456789abcdef", "build": {"id": "fedcba9876543210", "tensors": None},
            "num_layers": 4, "vocab_size": 512, "hidden_size": 64, "max_position_embeddings": 2048}


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
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: input of layer k
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: captures k + 1
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "meta.json", "model.safetensors"]
    tensors = load_file(folder / "model.safetensors")
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and tensors["d2t"].dtype == torch.int64
    assert not any("embed" in name for name in tensors)
    assert check_drafter(folder) == []


def truncate(path, keep: float = 0.5):
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


FAULTS = {
    "layers.0 instead of midlayer": (
        lambda f: edit_tensors(f, lambda t: {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}), "layers.0.*"),
    "missing lm_head": (lambda f: edit_tensors(f, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"}), "missing lm_head.weight"),
    "missing d2t": (lambda f: edit_tensors(f, lambda t: {k: v for k, v in t.items() if k != "d2t"}), "missing d2t"),
    "random embed_tokens": (lambda f: edit_tensors(f, lambda t: {**t, "embed_tokens.weight": torch.zeros(512, 64, dtype=torch.bfloat16)}), "embed_tokens"),
    "d2t outside the vocab": (lambda f: edit_tensors(f, lambda t: {**t, "d2t": t["d2t"] + 200}), "outside the verifier vocab"),
    "fp32 weights": (lambda f: edit_tensors(f, lambda t: {**t, "fc.weight": t["fc.weight"].float()}), "fc.weight is (64, 192) torch.float32"),
    "vllm ids in the sglang convention": (
        lambda f: edit_json(f / "config.json", lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2])),
        "config.json: vllm would tap layers [0, 1, 2], the drafter was trained on [1, 2, 3]"),
    "sglang ids in the vllm convention": (
        lambda f: edit_json(f / "config.json", lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3])),
        "config.json: sglang would tap layers [2, 3, 4], the drafter was trained on [1, 2, 3]"),
    "old export: only eagle_config, in the vllm convention": (
        lambda f: edit_json(f / "config.json", lambda c: (c.pop("eagle_aux_hidden_state_layer_ids"),
                                                          c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))),
        "config.json: vllm would tap layers [2, 2, 1]"),  # vLLM's default taps of a 4-layer verifier
    "too small context": (lambda f: edit_json(f / "config.json", lambda c: c.update(max_position_embeddings=1024)), "max_position_embeddings 1024 <"),
    "taps beyond the verifier": (lambda f: edit_json(f / "meta.json", lambda m: m.update(aux_layers=[1, 2, 4])), "aux_layers [1, 2, 4] must be 3 ascending layer ids in [1, 4)"),
    "truncated model.safetensors": (lambda f: truncate(f / "model.safetensors"), "not a readable safetensors file"),
    "a NaN weight": (lambda f: edit_tensors(f, lambda t: {**t, "fc.weight": t["fc.weight"].index_fill(0, torch.tensor([3]), float("nan"))}),
                     "model.safetensors: fc.weight has 192 NaN/Inf values of 12288"),
    "an Inf weight": (lambda f: edit_tensors(f, lambda t: {**t, "norm.weight": t["norm.weight"].index_fill(0, torch.tensor([0]), float("inf"))}),
                      "model.safetensors: norm.weight has 1 NaN/Inf values of 64"),
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


def test_truncated_weights_are_one_line_naming_the_file(exported, capsys):
    _, folder = exported
    truncate(folder / "model.safetensors")
    with pytest.raises(SystemExit):
        cli(["check-drafter", str(folder)])
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        f"{folder}: {folder / 'model.safetensors'}: not a readable safetensors file (Error while deserializing header: "
        "incomplete metadata, file not fully covered); export it again (`dvc repro -f train`)"]
    assert "Traceback" not in out.err


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


def export_with_taps(folder, taps, num_layers: int) -> None:
    folder.mkdir()
    write_drafter(make_drafter(aux_layers=taps), folder, {**VERIFIER, "num_layers": num_layers}, {})


def old_style(folder) -> None:
    """config.json as exported before: the taps only in eagle_config, in vLLM's convention."""
    config = json.loads((folder / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = config.pop("eagle_aux_hidden_state_layer_ids")
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("taps,num_layers", [((1, 2, 3), 4), ((1, 3, 7), 8), ((2, 4, 5), 8)],
                         ids=["tiny-verifier", "non-default", "default"])
def test_both_engines_resolve_the_trained_taps(tmp_path, taps, num_layers, capsys):
    """Each engine's lookup (vllm_taps, sglang_taps) gives the trained taps; an old-style config fails."""
    folder = tmp_path / "drafter"
    export_with_taps(folder, taps, num_layers)
    config = json.loads((folder / "config.json").read_text())
    for engine, resolve in ENGINE_TAPS.items():
        assert resolve(config, num_layers) == taps, engine
    assert check_drafter(folder) == []
    old_style(folder)
    problems = check_drafter(folder)
    assert any(p.startswith("config.json: sglang would tap layers") for p in problems), problems
    # vLLM falls back to its defaults, right only when the drafter was trained on them
    assert any(p.startswith("config.json: vllm would tap") for p in problems) == (taps != default_taps(num_layers))
    with pytest.raises(SystemExit):
        cli(["check-drafter", str(folder)])
    cli(["check-drafter", str(folder), "--rewrite-config"])
    assert f"{folder}: ok" in capsys.readouterr().out.splitlines()
    assert json.loads((folder / "config.json").read_text()) == config


def test_engine_lookups_without_taps_use_the_defaults():
    assert vllm_taps({}, 30) == sglang_taps({}, 30) == (2, 15, 27)
    assert sglang_taps({"eagle_config": {"use_aux_hidden_state": True}}, 30) == (2, 15, 27)
    assert vllm_taps({"eagle_config": {"layer_ids": [3, 9, 20]}}, 30) == (3, 9, 20)


def test_tap_zero_is_refused_at_export(tmp_path):
    """Both engines capture hidden_states + residual before layer k, which does not exist before layer 0."""
    with pytest.raises(ValueError, match="cannot be written for SGLang"):
        export_with_taps(tmp_path / "drafter", (0, 1, 3), 4)


def gemma_like_verifier(tmp_path, tiny_verifier_dir):
    """The tiny verifier's config and meta with Gemma's special token ids (BOS 2, EOS 1; Llama's are 1, 2)."""
    folder = tmp_path / "verifier"
    folder.mkdir()
    for name in ("config.json", "meta.json", "identity.json"):
        shutil.copy(tiny_verifier_dir / name, folder)
    edit_json(folder / "config.json", lambda c: c.update(bos_token_id=2, eos_token_id=1))
    return folder


def test_token_ids_are_the_verifiers(tmp_path, tiny_verifier_dir, capsys):
    verifier = gemma_like_verifier(tmp_path, tiny_verifier_dir)
    facts = verifier_facts(verifier)
    assert (facts["bos_token_id"], facts["eos_token_id"]) == (2, 1)
    cfg = DraftConfig.from_verifier(AutoConfig.from_pretrained(verifier), 1024, [1, 2, 3])
    drafter = Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, cfg.draft_vocab_size))
    folder = tmp_path / "drafter"
    folder.mkdir()
    write_drafter(drafter, folder, facts, {})
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 1)
    assert check_drafter(folder, verifier) == []

    edit_json(folder / "config.json", lambda c: c.update(bos_token_id=1, eos_token_id=2))  # as exported before
    assert check_drafter(folder, verifier) == [
        "config.json: bos_token_id 1 != the verifier's 2 (eagle3 check-drafter --rewrite-config --verifier models/verifier rewrites it)",
        "config.json: eos_token_id 2 != the verifier's 1 (eagle3 check-drafter --rewrite-config --verifier models/verifier rewrites it)"]
    cli(["check-drafter", str(folder), "--verifier", str(verifier), "--rewrite-config"])
    out = capsys.readouterr().out.splitlines()
    assert f"{folder}: ok" in out and f"--verifier {verifier} --output-path" in out[-1]  # the weights' folder
    assert json.loads((folder / "config.json").read_text()) == config


def test_ok_prints_the_speculators_command_with_the_taps(tmp_path, capsys, monkeypatch):
    """speculators convert ignores config.json's taps: the command check-drafter prints passes them."""
    folder = tmp_path / "drafter"
    export_with_taps(folder, (1, 3, 7), 8)
    cli(["check-drafter", str(folder)])
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"for speculators (it ignores config.json's taps): speculators convert {folder} --algorithm eagle3 "
        f"--verifier <verifier weights folder> --output-path {folder}-speculators "
        """--algorithm-kwargs '{"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}'""")
    monkeypatch.chdir(folder)
    assert f"--output-path {folder}-speculators " in speculators_command(".")


def test_a_draft_vocabulary_remapped_to_other_tokens_is_caught(tmp_path, tiny_verifier_dir, capsys):
    """d2t/t2d remapped consistently (t2d at d2t's targets, ascending, within the config's vocab) pass the export's own
    checks; against what is at hand they do not: the verifier's tokenizer (a config padded beyond its tokens) and
    merge's vocabulary file."""
    from tokenizers import Tokenizer

    from eagle3.merge import save_vocab

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_dir, verifier)
    tokens = Tokenizer.from_file(str(verifier / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "vocab_size": tokens + 4096}))  # padded rows, no tokens
    cfg = DraftConfig.from_verifier(AutoConfig.from_pretrained(verifier), 1024, [1, 2, 3])
    drafter = Eagle3Drafter(cfg, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    vocab = tmp_path / "vocab.safetensors"
    d2t = draft_d2t(tokens, cfg.draft_vocab_size)
    drafter.set_draft_vocab(d2t)
    save_vocab(vocab, d2t.numpy(), drafter.t2d.numpy(), "f", 0)
    folder = tmp_path / "drafter"
    folder.mkdir()
    write_drafter(drafter, folder, verifier_facts(verifier), {})
    cli(["check-drafter", str(folder), "--verifier", str(verifier), "--vocab", str(vocab)])
    assert capsys.readouterr().out.startswith(f"{folder}: ok")

    drafter.set_draft_vocab(d2t + 1)  # every draft token one id further: consistent, another vocabulary
    write_drafter(drafter, folder, verifier_facts(verifier), {})
    assert check_drafter(folder, verifier) == []
    with pytest.raises(SystemExit):
        cli(["check-drafter", str(folder), "--verifier", str(verifier), "--vocab", str(vocab)])
    assert capsys.readouterr().out.splitlines() == [
        f"{folder}: model.safetensors: d2t is not {vocab}'s (the draft vocabulary merge chose): 1024 entries differ, first "
        "at index 0 (1, the file's 0); train on this merge (`dvc repro train`) or check against the vocabulary file of the "
        "drafter's own run",
        f"{folder}: model.safetensors: t2d is not {vocab}'s (the draft vocabulary merge chose): 2048 entries differ, first "
        "at index 0 (0, the file's 1); train on this merge (`dvc repro train`) or check against the vocabulary file of the "
        "drafter's own run"]

    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, cfg.draft_vocab_size))  # spread over the padded rows too
    write_drafter(drafter, folder, verifier_facts(verifier), {})
    assert check_drafter(folder, verifier) == []
    with pytest.raises(SystemExit):
        cli(["check-drafter", str(folder), "--verifier", str(verifier)])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith(f"which {verifier / 'tokenizer.json'} does not have (its {tokens} tokens): a vocabulary of another "
                         "tokenizer"), line
