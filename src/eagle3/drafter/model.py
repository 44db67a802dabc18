"""The EAGLE-3 drafter: one Llama decoder layer over the verifier's tapped features (docs/design.md §1).

    cfg = DraftConfig.from_verifier(AutoConfig.from_pretrained("models/verifier"), 32000, [2, 15, 27])
    drafter = Eagle3Drafter(cfg, embed_tokens=verifier.get_input_embeddings().weight)
    drafter.set_draft_vocab(d2t)
    drafter.init_head(verifier.lm_head.weight, verifier.model.norm.weight)  # optional: the verifier's head

Why: the drafter must be the exact architecture SGLang and vLLM serve (``LlamaForCausalLMEagle3``),
so submodules carry the HF/engine names (``fc``, ``midlayer.self_attn.q_proj``, ``norm``, ``lm_head``)
and ``export.py`` only has to check them. The training objective lives in ``loss.py``; parallelism
in ``parallel.py``; this file is single-device.

One draft step::

    hidden = drafter.fc(aux)                                # [B, T, 3H] -> [B, T, H]  (u = fc(g))
    logits, h2 = drafter(input_ids, hidden, position_ids, cache)            # context step
    logits, h2 = drafter(next_ids, h2, position_ids + 1, cache, rows=rows)  # chain step

``logits`` [B, T, Vd] are over the draft vocabulary (target id = i + d2t[i]); ``h2`` [B, T, H] is
the pre-norm output, the hidden input of the next step. ``position_ids`` ([T] or [B, T]) are the
RoPE positions, always given by the caller.

Who sees which keys of the ``KVCache`` (context and chain steps, packed documents): ``attention.py``.
RoPE (the verifier's settings and scaling types): ``rope.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.drafter.attention import KVCache, cached_attention
from eagle3.drafter.fused import fused_when_training_on_gpu
from eagle3.drafter.rope import RotaryEmbedding, apply_rope, rope_frequencies, rope_settings
from eagle3.lm.spec import attention_shape

# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class DraftConfig:
    """The drafter's shape. No field has a default: every value comes from the verifier
    (``from_verifier``), an export (``export.config_from_export``) or a given shape (``create``)."""

    hidden_size: int  # H: the verifier's hidden size; aux features are 3H wide
    intermediate_size: int  # SwiGLU width of the draft layer
    num_attention_heads: int  # query heads; q_proj maps 2H -> heads * head_dim
    num_key_value_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # width of one attention head
    vocab_size: int  # V: the verifier's vocabulary (embedding rows, length of t2d)
    draft_vocab_size: int  # Vd: rows of lm_head, length of d2t
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base, the verifier's
    rope_scaling: dict | None  # HF rope scaling ({"rope_type": "llama3", ...}) or None
    max_position_embeddings: int  # context the drafter is exported for (>= the verifier's)
    aux_layers: tuple[int, ...]  # the verifier's taps, model.aux_layers (lm.spec.tap_problem)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size {self.vocab_size}")
        rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)  # refuses unknown rope types early

    @classmethod
    def from_verifier(cls, hf_config, draft_vocab_size: int, aux_layers, overrides: dict | None = None) -> DraftConfig:
        """Head shape of the verifier (an HF config), with ``overrides`` (conf/model ``draft_head``) on top."""
        heads, kv_heads, head_dim = attention_shape(hf_config)
        theta, scaling = rope_settings(hf_config)
        values = dict(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            aux_layers=tuple(aux_layers),
        )
        return cls.create(values, overrides or {})

    @classmethod
    def create(cls, values: dict, overrides: dict) -> DraftConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown drafter setting(s) {unknown}; known: {sorted(known)}")
        merged = {**values, **overrides}
        if "aux_layers" in merged:
            merged["aux_layers"] = tuple(merged["aux_layers"])
        if merged.get("rope_scaling"):
            merged["rope_scaling"] = dict(merged["rope_scaling"])  # a copy: HF configs edit theirs in place
        return cls(**merged)

    def to_dict(self) -> dict:
        return {**asdict(self), "aux_layers": list(self.aux_layers)}


# ---------------------------------------------------------------------------------------------
# Blocks


@fused_when_training_on_gpu
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF Llama's RMSNorm: normalised in fp32, cast back to x's dtype, then scaled."""
    wide = x.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide concat(embedding, hidden)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, rows: Tensor | None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        last = cache.add_context(k, v) if rows is None else cache.add_chain(k, v, rows)
        out = cached_attention(q, cache, last)  # [B, nh, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@fused_when_training_on_gpu
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class DraftLayer(nn.Module):
    """The one decoder layer (``midlayer``): attention input concat(norm(embedding), norm(hidden))."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, cache: KVCache, rows: Tensor | None) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)  # [B, T, 2H]
        h1 = hidden + self.self_attn(x, cos, sin, cache, rows)  # residual is the un-normed hidden
        return h1 + self.mlp(self.post_attention_layernorm(h1))


# ---------------------------------------------------------------------------------------------
# Model


class Eagle3Drafter(nn.Module):
    """fc (3H -> H), one decoder layer, final norm, lm_head over Vd; the verifier's embedding, frozen.

    ``embed_tokens`` is a non-persistent buffer: never trained, never in a state dict or export.
    ``d2t`` [Vd] (target id = i + d2t[i]) and ``t2d`` [V] (membership) are exported buffers.
    """

    def __init__(self, cfg: DraftConfig, embed_tokens: Tensor):
        super().__init__()
        if tuple(embed_tokens.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embed_tokens {tuple(embed_tokens.shape)} != (vocab_size, hidden_size) {(cfg.vocab_size, cfg.hidden_size)}")
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("embed_tokens", embed_tokens.detach(), persistent=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    @torch.no_grad()
    def set_draft_vocab(self, d2t: Tensor) -> None:
        """Install the draft vocabulary: d2t [Vd] (int64); t2d follows from it."""
        if tuple(d2t.shape) != (self.config.draft_vocab_size,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}, expected ({self.config.draft_vocab_size},)")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[torch.arange(len(d2t), device=d2t.device) + d2t] = True

    @torch.no_grad()
    def init_head(self, lm_head_weight: Tensor, norm_weight: Tensor) -> None:
        """Start from the verifier's head: lm_head row i = the verifier's lm_head row i + d2t[i]
        (call after ``set_draft_vocab``), norm = the verifier's final norm.

        Why: the drafter's h2 plays the part of the verifier's last residual stream, so with the
        verifier's own head on top its step-0 predictions start from the verifier's token
        geometry instead of noise (and the lm_head, Vd x H, can stay frozen).
        """
        self.lm_head.weight.copy_(lm_head_weight[torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t])
        self.norm.weight.copy_(norm_weight)

    def forward(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache,
                rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One draft step: tokens [B, T], hidden [B, T, H] -> (logits [B, T, Vd], h2 [B, T, H])."""
        h2 = self.step(input_ids, hidden, position_ids, cache, rows)
        return self.logits(h2), h2

    def step(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache,
             rows: Tensor | None = None) -> Tensor:
        """The decoder layer of one draft step: h2 [B, T, H] (``forward`` without the lm_head)."""
        cos, sin = self.rotary(position_ids, hidden.dtype)
        embeds = F.embedding(input_ids, self.embed_tokens)  # [B, T, H]
        return self.midlayer(embeds, hidden, cos, sin, cache, rows)

    def logits(self, h2: Tensor) -> Tensor:
        """Draft-vocab logits [..., Vd] of pre-norm states h2 [..., H]."""
        return self.lm_head(self.norm(h2))
