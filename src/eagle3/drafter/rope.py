"""RoPE of the draft layer: the verifier's settings, the frequencies of each scaling type, the rotation.

    theta, scaling = rope_settings(hf_config)                 # from any HF config layout
    rotary = RotaryEmbedding(head_dim, theta, scaling)
    cos, sin = rotary(position_ids, dtype)                     # [..., T, hd]
    q = apply_rope(q, cos, sin)                                # [B, nh, T, hd]

Why: the drafter must rotate exactly as the verifier does (default, linear, Llama 3.1 or YaRN
scaling), and the exported config must state exactly that RoPE (``ROPE_KEYS``); the model only
calls ``RotaryEmbedding`` and ``apply_rope``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from eagle3.drafter.fused import fused_when_training_on_gpu


# RoPE scaling types the drafter implements, with the keys each one reads. Anything else in a
# verifier's RoPE dict (partial_rotary_factor, MLA details) is not the drafter's RoPE and is dropped,
# so the exported config states exactly what the drafter was trained with.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}


def rope_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ROPE_KEYS:
        raise ValueError(f"rope type {kind!r} is not supported ({', '.join(ROPE_KEYS)}); override draft_head.rope_scaling")
    return kind


def rope_settings(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling) of the verifier's full-attention layers, from any config layout.

    - transformers 5: ``rope_parameters`` = {"rope_type", "rope_theta", ...};
    - transformers 5, per layer type: ``rope_parameters`` = {"full_attention": {...}, "sliding_attention":
      {...}} (Gemma-3 style hybrids): the drafter attends over the whole context, so it follows the
      full-attention layers;
    - older configs: ``rope_theta`` plus ``rope_scaling`` = {"type" or "rope_type", ...} or null.

    ``scaling`` keeps only its type's keys (ROPE_KEYS) under "rope_type"; None for plain RoPE.
    Example: {"full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention":
    {"rope_type": "default", "rope_theta": 1e4}} -> (1e6, None).
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    elif params and all(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"the verifier's rope_parameters are per layer type {sorted(params)} without full_attention; "
                         "set draft_head.rope_theta and draft_head.rope_scaling")
    theta = float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    return theta, {"rope_type": kind, **{key: params[key] for key in ROPE_KEYS.get(kind, ()) if key in params}}


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] of RoPE; ``scaling`` is HF's rope_scaling (ROPE_KEYS types)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "yarn":
        return yarn_frequencies(inv_freq, head_dim, theta, scaling).float()
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    blend = ((old_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 0: long, 1: short
    scaled = (1 - blend) * inv_freq / factor + blend * inv_freq
    return scaled.float()


def yarn_frequencies(inv_freq: Tensor, head_dim: int, theta: float, scaling: dict) -> Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context are
    interpolated (frequency / factor), those turning more than ``beta_fast`` times are kept, with a
    linear ramp over the dimension pairs between."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_turning(rotations: float) -> float:  # the dimension pair index that turns ``rotations`` times
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)  # 1: interpolate
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor on cos/sin: YaRN's attention temperature, 1 for the other types."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return m(factor, mscale) / m(factor, mscale_all_dim) if mscale and mscale_all_dim else m(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_frequencies(head_dim, theta, scaling), persistent=False)
        self.attention_factor = rope_attention_factor(scaling)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [..., T, head_dim] for positions [..., T]."""
        freqs = position_ids[..., None].float() * self.inv_freq  # [..., T, hd/2]
        angles = torch.cat([freqs, freqs], -1)  # [..., T, hd]
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)


@fused_when_training_on_gpu
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, hd] by cos/sin [..., T, hd] (half-split layout, as HF Llama)."""
    cos, sin = cos.unsqueeze(-3).to(x.dtype), sin.unsqueeze(-3).to(x.dtype)  # [..., 1, T, hd]: broadcast over heads
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], -1) * sin
