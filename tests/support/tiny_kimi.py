"""A tiny verifier shaped like Kimi-K2.5's checkpoint, built locally with random weights.

Kimi-K2.5 is a vision wrapper (``KimiK25ForConditionalGeneration``, model type ``kimi_k25``) whose
config nests the text model's under ``text_config`` (type ``kimi_k2``: DeepSeek-V3 with MLA
attention, 384 routed + 1 shared experts, the first layer dense) and whose weights put it under
``language_model.`` beside ``vision_tower.*`` and ``mm_projector.*``; its tokenizer is remote code
(``tokenization_kimi.py``, no offset mapping) and its chat template opens ``<think>`` in the
generation prompt. ``TINY_KIMI`` keeps that structure and those key names with every size cut
down (hidden 7168 -> 64, 61 layers -> 4, 384 experts -> 8, MLA ranks and head dims in the same
proportions); ``build`` writes such a checkpoint (plus a small vision shard and an index that
lists both) with ``tokenization_tiny_kimi.py`` as its remote-code tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from eagle3.common import read_json, write_json
from support.repo import ROOT

BPE_TOKENS = 49152  # SmolLM2's BPE vocabulary, the core of the tiny tokenizer
SPECIAL = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>"]

# Kimi-style turns; the last answer's reasoning is rendered inside <think>, earlier answers get an
# empty one; the generation prompt opens <think> (thinking mode).
CHAT_TEMPLATE = (
    "{%- if messages[0].role != 'system' -%}<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>{%- endif -%}"
    "{%- set last = namespace(user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>"
    "{%- if m.role == 'assistant' -%}"
    "<think>{{ (m.reasoning_content or '') if loop.index0 > last.user else '' }}</think>"
    "{%- endif -%}"
    "{{ m.content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}"
)

TEXT = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="kimi_k2",  # a remote-code type: transformers builds it as deepseek_v3
    vocab_size=49280,  # SmolLM2's 49,152 BPE tokens + the Kimi markers + reserved tokens
    hidden_size=64,
    intermediate_size=160,  # dense layers: 18432 / 7168 of hidden
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_nextn_predict_layers=0,
    max_position_embeddings=2048,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

TINY_KIMI = dict(
    architectures=["KimiK25ForConditionalGeneration"],
    model_type="kimi_k25",
    text_config=TEXT,
    vision_config=dict(vt_hidden_size=16, vt_num_hidden_layers=1, vt_num_attention_heads=2, mm_hidden_size=16,
                       text_hidden_size=64, patch_size=14, merge_kernel_size=[2, 2]),
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)

LANGUAGE_MODEL = {"config": "text_config", "prefix": "language_model.", "model_type": "deepseek_v3"}


def build_tokenizer(smollm2_dir: Path, out: Path) -> Path:
    """The remote-code tokenizer folder: SmolLM2's BPE, the Kimi markers as special tokens, the Kimi-style template."""
    from support.tokenization_tiny_kimi import TinyKimiTokenizer

    # Like Kimi's tokenizer, reserved special tokens fill the vocabulary up to the model's rows, so
    # any id a random model samples decodes to something.
    reserved = [f"<|reserved_token_{i}|>" for i in range(TEXT["vocab_size"] - BPE_TOKENS - len(SPECIAL))]
    tokenizer = TinyKimiTokenizer(str(smollm2_dir / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  additional_special_tokens=SPECIAL + reserved)
    assert len(tokenizer) == TEXT["vocab_size"]
    tokenizer.chat_template = CHAT_TEMPLATE
    TinyKimiTokenizer.register_for_auto_class("AutoTokenizer")
    tokenizer.save_pretrained(out)
    return out


def add_vision_shard(folder: Path) -> None:
    """A second safetensors file with the wrapper's vision weights, and the index listing both files."""
    import torch
    from safetensors.torch import save_file

    from eagle3.lm.loading import checkpoint_names

    text = checkpoint_names(folder)
    vision = {"vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 14, 14),
              "mm_projector.proj.0.weight": torch.randn(64, 64)}
    save_file(vision, folder / "model-vision.safetensors", metadata={"format": "pt"})
    weight_map = {**{name: "model.safetensors" for name in text}, **{name: "model-vision.safetensors" for name in vision}}
    write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})


def model_params(source: dict, name: str = "tiny-kimi"):
    """A ``model`` params section for the tiny Kimi-shaped verifier (the Kimi-K2.5 conf with tiny sizes)."""
    spec = OmegaConf.load(ROOT / "conf" / "model" / "kimi-k2.5.yaml")
    spec.name = name
    spec.source = source
    spec.copy_weights = source["kind"] == "random"
    spec.num_layers = TEXT["num_hidden_layers"]
    spec.max_position_embeddings = TEXT["max_position_embeddings"]
    spec.aux_layers = [1, 2, 3]
    spec.language_model = LANGUAGE_MODEL
    spec.placement = {"tp": 1, "ep": 1}
    spec.draft_head = {"head_dim": 16, "rope_scaling": None}
    return spec


def build(smollm2_dir: Path, out: Path) -> Path:
    """The tiny Kimi-shaped checkpoint folder (what a download of the real one looks like, sizes aside)."""
    from eagle3.verifier import import_verifier

    tokenizer = build_tokenizer(smollm2_dir, out.with_name(out.name + "-tokenizer"))
    source = {"kind": "random", "tokenizer": str(tokenizer), "config": TINY_KIMI, "seed": 0, "dtype": "float32"}
    import_verifier(model_params(source), out)
    add_vision_shard(out)
    assert read_json(out / "config.json")["text_config"]["model_type"] == "kimi_k2"
    return out
