"""Verifiers shaped like Kimi-K2.5: a vision wrapper around a DeepSeek-V3 text model under ``language_model.``.

The tiny Kimi-shaped checkpoint (tests/support/tiny_kimi.py) keeps the real one's nesting, key names and
remote-code tokenizer; the stages must find the text model through ``model.language_model``.
"""

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open

from eagle3.common import UserError
from eagle3.drafter.export import verifier_facts
from eagle3.lm.loading import language_model, load_tokenizer, load_verifier, verifier_parts, weights_dir
from eagle3.lm.spec import LanguageModel
from eagle3.verifier import import_verifier
from support import tiny_kimi
from support.pipeline import LOCAL_SOURCE, SMALL, SMALL_ROWS, add_dataset, write_local_prompts
from support.repo import run


def kimi_model(folder, **changes):
    spec = tiny_kimi.model_params({"kind": "hf", "id": str(folder), "dtype": "float32"})
    for key, value in changes.items():
        OmegaConf.update(spec, key, value, merge=False)
    return spec


def raw_tensor(folder, name):
    with safe_open(folder / "model.safetensors", framework="pt") as part:
        return part.get_tensor(name)


def test_text_model_is_loaded_from_under_its_prefix(tiny_kimi_dir, tmp_path):
    out = tmp_path / "verifier"
    import_verifier(kimi_model(tiny_kimi_dir), out)
    assert language_model(out) == LanguageModel(**tiny_kimi.LANGUAGE_MODEL)
    assert weights_dir(out) == tiny_kimi_dir.resolve() and not list(out.glob("*.safetensors"))
    assert (out / "tokenization_tiny_kimi.py").is_file()  # the remote-code tokenizer travels with the folder
    model = load_verifier(out, trust_remote_code=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and not any("vision" in n for n, _ in model.named_parameters())
    embed = raw_tensor(tiny_kimi_dir, "language_model.model.embed_tokens.weight")
    assert torch.equal(model.get_input_embeddings().weight, embed)
    config, tensors = verifier_parts(out)
    assert config.hidden_size == 64 and torch.equal(tensors["embed"], embed)
    assert torch.equal(tensors["head"], raw_tensor(tiny_kimi_dir, "language_model.lm_head.weight"))
    assert verifier_facts(out)["num_layers"] == 4
    assert not load_tokenizer(out, trust_remote_code=True).is_fast  # like Kimi's tiktoken tokenizer: no offsets


def test_wrong_prefix_names_the_embedding_it_has(tiny_kimi_dir, tmp_path):
    with pytest.raises(UserError, match="language_model.model.embed_tokens.weight"):
        import_verifier(kimi_model(tiny_kimi_dir, **{"language_model.prefix": "model."}), tmp_path / "v")


def test_undeclared_wrapper_is_refused_with_the_keys_to_set(tiny_kimi_dir, tmp_path):
    plain = {"config": None, "prefix": "", "model_type": None}
    with pytest.raises(UserError, match="model.language_model"):
        import_verifier(kimi_model(tiny_kimi_dir, language_model=plain), tmp_path / "v")


def test_remote_code_text_type_needs_a_transformers_type(tiny_kimi_dir, tmp_path):
    with pytest.raises(UserError, match="model.language_model.model_type"):
        import_verifier(kimi_model(tiny_kimi_dir, **{"language_model.model_type": None}), tmp_path / "v")


@pytest.mark.slow
def test_kimi_shaped_verifier_through_every_stage(make_project, tiny_kimi_dir):
    fast = ["generate.max_new_tokens=12", "merge.min_tokens=1", *SMALL_ROWS, "evaluate.max_new_tokens=8",
            "evaluate.max_prompts=1", "evaluate.sets=[heldout]", "evaluate.tree=null", "evaluate.baseline=false",
            "layout.threads=1"]
    repo = make_project(*fast, model=kimi_model(tiny_kimi_dir))
    add_dataset(repo, {**SMALL, **LOCAL_SOURCE})
    write_local_prompts(repo)
    run(["eagle3", "params", "-S", "model=tiny-kimi", "-S", "dataset=small", *[a for f in fast for a in ("-S", f)]], repo)
    ran = run(["dvc", "repro"], repo).stdout
    for stage in ("verifier", "prompts", "generate@000000-000008", "extract@000000-000008", "merge", "train", "evaluate"):
        assert f"Running stage '{stage}'" in ran
    extracted = json.loads((repo / "data/hidden_states/000000-000008/meta.json").read_text())
    assert extracted["hidden_size"] == 64 and extracted["counts"]["samples"] > 0
    metrics = json.loads((repo / "dvclive/evaluate/metrics.json").read_text())
    assert metrics["heldout"]["lossless"] == 1.0
    assert run(["eagle3", "check-drafter", "models/drafter", "--verifier", "models/verifier"], repo).returncode == 0
