"""The drafter's RoPE read from every config layout, computed like the verifier's, exported as it is.

Each case is a verifier config as its config.json states it (older ``rope_theta``/``rope_scaling``,
transformers 5 ``rope_parameters``, per layer type, YaRN, Llama 3). The drafter's frequencies and
cos/sin factor must equal those of the verifier's own (full-attention) rotary embedding, whether
``rope_settings`` reads the raw JSON (as ``train`` does) or transformers' parsed config, and the
exported config.json, loaded by transformers, must give the same again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3.drafter.export import config_from_export, engine_config
from eagle3.drafter.model import DraftConfig
from eagle3.drafter.rope import RotaryEmbedding, rope_settings

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=65536)
YARN = {"factor": 4.0, "original_max_position_embeddings": 16384, "beta_fast": 32, "beta_slow": 1}

# (model_type, config.json RoPE keys as written, expected drafter theta and scaling type)
LAYOUTS = {
    "older: rope_theta, no scaling": ("llama", {"rope_theta": 100000.0, "rope_scaling": None}, 1e5, None),
    "older: rope_scaling with type=llama3": ("llama", {"rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}, 5e5, "llama3"),
    "older: YaRN (Qwen style)": ("qwen3", {"rope_theta": 1000000.0, "rope_scaling": {"rope_type": "yarn", **YARN}},
                                 1e6, "yarn"),
    "older: linear": ("llama", {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, 1e4, "linear"),
    "transformers 5: rope_parameters": ("mistral", {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
                                        2.5e5, None),
    "transformers 5: YaRN with mscale (DeepSeek-V3)": ("deepseek_v3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}, 1e4, "yarn"),
    "transformers 5: per layer type (Gemma-3 style)": ("gemma3_text", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1000000.0, **YARN},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}, 1e6, "yarn"),
}
SHAPES = {"deepseek_v3": dict(qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, kv_lora_rank=32, q_lora_rank=None,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1),
          "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16)}


def verifier_rope(model_type: str, rope: dict) -> tuple[torch.Tensor, float]:
    """The verifier's own inverse frequencies and cos/sin factor (of its full-attention layers)."""
    config = AutoConfig.for_model(model_type, **TINY, **SHAPES.get(model_type, {}), **rope)
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    if hasattr(rotary, "full_attention_inv_freq"):  # one RoPE per layer type
        return rotary.full_attention_inv_freq, rotary.full_attention_attention_scaling
    return rotary.inv_freq, rotary.attention_scaling


@pytest.mark.parametrize("layout", LAYOUTS)
def test_drafter_rope_follows_the_verifier_and_is_exported_as_trained(layout):
    model_type, rope, theta, kind = LAYOUTS[layout]
    expected_freq, expected_factor = verifier_rope(model_type, rope)
    parsed = AutoConfig.for_model(model_type, **TINY, **SHAPES.get(model_type, {}), **rope)
    readings = {"raw config.json": SimpleNamespace(**TINY, **rope), "transformers' config": parsed,
                "config.json saved by transformers 5": SimpleNamespace(**parsed.to_dict())}
    for reading, config in readings.items():
        got_theta, scaling = rope_settings(config)
        assert (got_theta, (scaling or {}).get("rope_type")) == (theta, kind), reading
        cfg = DraftConfig.from_verifier(config, 128, [1, 2, 3])
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        torch.testing.assert_close(rotary.inv_freq, expected_freq.float(), rtol=1e-5, atol=0, msg=reading)
        assert rotary.attention_factor == pytest.approx(expected_factor), reading

    exported = engine_config(cfg)
    assert (exported["rope_theta"], exported["rope_scaling"]) == (cfg.rope_theta, cfg.rope_scaling)
    served = LlamaRotaryEmbedding(LlamaConfig(**exported))  # how transformers reads the export
    torch.testing.assert_close(served.inv_freq, expected_freq.float(), rtol=1e-5, atol=0)
    assert served.attention_scaling == pytest.approx(expected_factor)
    assert config_from_export(exported, cfg.aux_layers) == cfg


def test_drafter_cos_sin_carry_the_yarn_attention_factor():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    cos, sin = RotaryEmbedding(32, 10000.0, scaling)(torch.arange(8), torch.float32)
    assert torch.allclose(cos[0], torch.full((32,), 0.1 * torch.log(torch.tensor(4.0)).item() + 1.0))
    assert sin.shape == (8, 32)


def test_unsupported_rope_types_and_per_layer_dicts_without_full_attention_are_refused():
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        DraftConfig.from_verifier(SimpleNamespace(**TINY, rope_scaling={"type": "dynamic", "factor": 2.0}), 128, [1, 2, 3])
    sliding_only = SimpleNamespace(**TINY, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="without full_attention; set draft_head.rope_theta"):
        rope_settings(sliding_only)
