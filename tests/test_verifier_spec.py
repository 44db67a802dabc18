"""The verifier spec: each rule about the verifier, once (taps, fingerprint refusal, features, nested configs)."""

from __future__ import annotations

import importlib

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlavaConfig

from eagle3.common import UserError
from eagle3.lm.spec import ModelSettings, VerifierSpec, require_verifier, tap_problem, tapped_features, verifier_mismatch
from eagle3.settings import StageParams, keys_of, stage_params

from support.repo import ROOT, project_params


def test_tap_rule_matches_docstring():
    assert tap_problem([2, 15, 27], 30) is None and tap_problem([1, 2, 3], 0) is None  # 0: layer count unknown
    for bad in ([2, 15, 30], [15, 2, 27], [2, 2, 27], [2, 15], [-1, 2, 3], [0, 15, 27]):
        assert "must be 3 ascending layer ids in [1, 30)" in tap_problem(bad, 30)
    assert tap_problem([0, 1, 2], 0).endswith("ids >= 1 (and below the verifier's layer count)")  # no bound to name


def test_fingerprint_refusal_is_one_line():
    assert verifier_mismatch("m.json", "built for", "ab12", "ab12") is None
    assert verifier_mismatch("m.json", "built for", "ab12", "cd34") == "m.json: built for verifier ab12, models/verifier is cd34"
    with pytest.raises(UserError, match=r"^m.json: built for verifier ab12, models/verifier is cd34; re-run `dvc repro`$"):
        require_verifier("m.json", "built for", "ab12", "cd34")


def test_tapped_features_concatenate_in_tap_order():
    states = [torch.full((1, 2, 3), float(k)) for k in range(5)]  # HF hidden_states: [k] enters layer k
    features = tapped_features(states, (1, 2, 4))
    assert features.shape == (1, 2, 9) and features[0, 0].tolist() == [1.0] * 3 + [2.0] * 3 + [4.0] * 3


def test_spec_reads_the_language_model_of_a_nested_config():
    model = project_params().model  # SmolLM2: taps [2, 15, 27] of 30 layers
    spec = VerifierSpec.from_params(model)
    assert spec.aux_layers == (2, 15, 27) and spec.num_layers == 30 and spec.final_state == "post-norm"
    nested = LlavaConfig(text_config=LlamaConfig(num_hidden_layers=16).to_dict())  # a multimodal wrapper
    with pytest.raises(UserError, match=r"model.aux_layers \[2, 15, 27\] must be 3 ascending layer ids in \[1, 16\)"):
        VerifierSpec.from_params(model, nested)
    assert VerifierSpec.from_params(OmegaConf.merge(model, {"aux_layers": [1, 8, 13]}), nested).num_layers == 16
    with pytest.raises(UserError, match="model.final_state"):
        VerifierSpec.from_params(OmegaConf.merge(model, {"final_state": "pre-norm"}))


IMPORT_KEYS = {"model.source", "model.copy_weights"}  # where the verifier stage gets the weights, not what they are


@pytest.mark.parametrize("stage", ["verifier", "prompts", "generate", "extract", "merge", "train", "evaluate", "summary"])
def test_every_model_key_a_stage_declares_is_read_by_the_spec(stage):
    """What varies by verifier reaches a stage only through the spec: a family is a conf/model file (plus a spec change
    for a rule it breaks), never a stage edit."""
    declared = {key for key in importlib.import_module(f"eagle3.{stage}").PARAMS if key.startswith("model.")}
    assert declared - IMPORT_KEYS <= {f"model.{key}" for key in VerifierSpec.keys()}


def test_a_spec_holds_only_what_its_stage_declares():
    spec = VerifierSpec.from_params(stage_params(StageParams(keys_of(ModelSettings, "draft_head")), ROOT / "params.yaml").model)  # train's view
    assert spec.draft_head == {}
    with pytest.raises(KeyError, match="model.aux_layers: not among this stage's declared params"):
        spec.aux_layers  # noqa: B018 (the read itself must fail)
    whole = VerifierSpec.from_params(project_params().model)
    assert whole.chat.end_of_turn == "<|im_end|>" and whole.language_model.nested is False
