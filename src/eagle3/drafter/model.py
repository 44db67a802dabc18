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

Attention and the cache. A ``KVCache`` holds keys/values (RoPE applied) of two kinds:

- context keys, one per sequence position, written by context steps (``rows=None``): step 0 of
  training-time test; when decoding, the prefill over the prompt and the re-run over accepted
  tokens. A query at context index i sees context keys 0..i (causal); in training, rows pack
  several documents and a query sees the keys of its own document only (``KVCache.starts``).
- chain keys, written by chain steps (``rows`` = the context index each query row continues):
  steps 1..k of training-time test (``rows = arange(T)``); when decoding, the K drafted tokens
  one at a time (``rows = tensor([n])`` for a prompt of n+1 tokens). A chain query sees the
  context keys 0..rows[r] plus the chain keys of its own row only. A context step clears the chain.

Worked example, T=3, training-time test step 2: the query of row 1 sees context keys {0, 1}
(step 0, RoPE positions 0, 1) and chain keys of row 1 from steps 1 and 2 (RoPE positions 2, 3);
never row 0's or row 2's chain keys. Decoding a 5-token prompt: prefill is a context step over
rows 0..4 at positions 0..4; the drafts are chain steps with rows=[4] at positions 5, 6, ...
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------
# Blocks


def fused_when_training_on_gpu(fn):
    """``fn`` compiled into generated kernels (torch.compile) when it runs with gradients on a GPU.

    Why: norms, RoPE, SwiGLU, the chain merge and the soft CE are chains of elementwise ops over
    [B·T, H]- and [N, Vd]-sized tensors; run op by op, each one is a round trip through GPU memory,
    about a quarter of an 8B-shaped training step. Fused, forward and backward each read and write
    them once. Decoding (no gradients) and CPUs keep the eager ops: decoding's few rows are
    launch-bound and would recompile for every new length, and compiling on a CPU costs more than
    the demo's whole training saves. The first call of a new shape compiles (dynamic after that).
    """
    compiled = None

    @functools.wraps(fn)
    def call(x: Tensor, *args):
        nonlocal compiled
        if not (x.is_cuda and torch.is_grad_enabled()):
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True)
        return compiled(x, *args)

    call.eager = fn  # what the fused kernels must compute (tests compare the two)
    return call


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


@dataclass
class KVCache:
    """Keys/values of the draft layer (RoPE applied); see the module docstring for who sees what.

    ``starts`` makes the cache causal (training-time test): the context is written by one context
    step and every query is over all of its rows in order. Rows are packed with documents: row r's
    document begins at context index starts[b, r], and r sees context keys starts[b, r]..r only;
    on GPUs that part runs in one fused FlexAttention kernel instead of a masked matmul.

    Worked example, one row packing documents of 3 and 2 tokens: starts [0, 0, 0, 3, 3]; row 4
    sees context keys {3, 4}, row 2 sees {0, 1, 2}.
    """

    k: Tensor | None = None  # [B, nkv, S, hd] context keys
    v: Tensor | None = None  # [B, nkv, S, hd]
    chain_k: Tensor | None = None  # [B, nkv, R, J, hd] J chain steps for each of R rows
    chain_v: Tensor | None = None  # [B, nkv, R, J, hd]
    starts: Tensor | None = None  # [B, S] first context index of each row's document; None: not causal
    block_mask: object = None  # the FlexAttention mask of ``starts``, built once for all steps

    @property
    def causal(self) -> bool:
        return self.starts is not None

    def add_context(self, k: Tensor, v: Tensor) -> Tensor:
        """Append T context keys [B, nkv, T, hd]; returns the last context index each query sees [T]."""
        start = 0 if self.k is None else self.k.shape[2]
        if self.causal and start:
            raise ValueError("a causal cache holds one context step")
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        self.chain_k = self.chain_v = None
        return torch.arange(start, start + k.shape[2], device=k.device)

    def add_chain(self, k: Tensor, v: Tensor, rows: Tensor) -> Tensor:
        """Append one chain step's keys [B, nkv, R, hd] for rows [R]; returns rows."""
        if self.k is None:
            raise ValueError("a chain step needs a context step first")
        if self.chain_k is not None and self.chain_k.shape[2] != k.shape[2]:
            raise ValueError(f"chain step over {k.shape[2]} rows, the chain has {self.chain_k.shape[2]}")
        if self.causal and k.shape[2] != self.k.shape[2]:
            raise ValueError(f"a causal cache's chain steps cover all {self.k.shape[2]} rows, not {k.shape[2]}")
        k, v = k.unsqueeze(3), v.unsqueeze(3)  # [B, nkv, R, 1, hd]
        self.chain_k = k if self.chain_k is None else torch.cat([self.chain_k, k], 3)
        self.chain_v = v if self.chain_v is None else torch.cat([self.chain_v, v], 3)
        return rows


def masked_attention(q: Tensor, k: Tensor, v: Tensor, last: Tensor, first: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, nh, R, hd] over keys first[b, r]..last[r] of k, v [B, nkv, S, hd] -> (out [B, nh, R, hd], lse [B, nh, R] fp32).

    ``first`` [B, R] (default 0) is where the query's document begins; every query sees at least
    its own key (first <= last), so no row of scores is all -inf. ``last`` may instead be a bool
    mask of the visible keys, [B, 1, 1, R, S] (batched decoding, where each sequence of the batch
    has its own holes: padding, rejected drafts).
    """
    B, nh, R, hd = q.shape
    nkv = k.shape[1]
    qg = q.view(B, nkv, nh // nkv, R, hd)  # query head h uses KV head h // (nh / nkv)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)).float() / math.sqrt(hd)  # [B, nkv, g, R, S]
    if last.dtype == torch.bool:
        visible = last
    else:
        keys = torch.arange(k.shape[2], device=q.device)
        visible = (keys <= last[:, None])[None]  # [1, R, S]
        if first is not None:
            visible = visible & (keys >= first[..., None])  # [B, R, S]
        visible = visible[:, None, None]  # [B or 1, 1, 1, R, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)  # [B, nkv, g, R]
    out = (scores - lse[..., None]).exp().to(q.dtype) @ v.unsqueeze(2)  # [B, nkv, g, R, hd]
    return out.reshape(B, nh, R, hd), lse.reshape(B, nh, R)


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # uncompiled, flex attention materialises the scores


def document_block_mask(starts: Tensor):
    """FlexAttention mask of packed rows: query q sees keys starts[b, q]..q (its own document, causal)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = starts.shape
    return create_block_mask(lambda b, h, q, k: (q >= k) & (k >= starts[b, q]), B, None, T, T, device=starts.device)


def fused_causal_attention(q: Tensor, k: Tensor, v: Tensor, block_mask) -> tuple[Tensor, Tensor]:
    """Causal q [B, nh, T, hd] over k, v [B, nkv, T, hd] within documents, in one kernel (FlexAttention).

    Same contract as ``masked_attention`` with last = 0..T-1 and first = the ``document_block_mask``
    starts. The log-sum-exp is differentiable, which the chain keys of training-time test need:
    they are merged in outside the kernel.
    """
    out, lse = compiled_flex_attention()(
        q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], return_lse=True,
    )
    return out, lse.float()


def cached_attention(q: Tensor, cache: KVCache, last: Tensor) -> Tensor:
    """Attention of q [B, nh, R, hd] over the cache: context keys 0..last[r] (from the document
    start with ``cache.starts``), plus row r's chain keys.

    The context part comes with its log-sum-exp, so the few chain keys of each row are merged in
    exactly (one softmax over both) without ever forming a [R, S + J] score matrix per row.
    """
    if cache.causal and q.is_cuda:
        if cache.block_mask is None:
            cache.block_mask = document_block_mask(cache.starts)
        out, lse = fused_causal_attention(q, cache.k, cache.v, cache.block_mask)
    else:
        out, lse = masked_attention(q, cache.k, cache.v, last, None if cache.starts is None else cache.starts[:, last])
    if cache.chain_k is None:
        return out
    B, nh, R, hd = q.shape
    nkv = cache.k.shape[1]
    qg = q.view(B, nkv, nh // nkv, R, hd)
    chain = torch.einsum("bkgrd,bkrjd->bkgrj", qg, cache.chain_k).float() / math.sqrt(hd)  # [B, nkv, g, R, J]
    total, chain_probs = chain_softmax(lse, chain.reshape(B, nh, R, -1), q.dtype)
    chain_out = torch.einsum("bkgrj,bkrjd->bkgrd", chain_probs.view(B, nkv, nh // nkv, R, -1), cache.chain_v)
    return merge_chain(out, lse, total, chain_out.reshape(B, nh, R, hd))


@fused_when_training_on_gpu
def chain_softmax(lse: Tensor, chain: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Context log-sum-exp [B, nh, R] and chain scores [B, nh, R, J] -> (log-normaliser over both
    [B, nh, R], chain probabilities [B, nh, R, J] in ``dtype``)."""
    total = torch.logaddexp(lse, chain.logsumexp(-1))
    return total, (chain - total[..., None]).exp().to(dtype)


@fused_when_training_on_gpu
def merge_chain(out: Tensor, lse: Tensor, total: Tensor, chain_out: Tensor) -> Tensor:
    """The context part ``out`` (normalised over the context only) rescaled to the joint softmax, plus the chain part."""
    return ((lse - total).exp()[..., None] * out.float() + chain_out.float()).to(out.dtype)


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
    aux_layers: tuple[int, ...]  # taps: residual stream entering layer k (verifiers.spec.tap_problem)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} not a multiple of num_key_value_heads {self.num_key_value_heads}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size {self.vocab_size}")
        rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)  # refuses unknown rope types early

    @classmethod
    def from_verifier(cls, hf_config, draft_vocab_size: int, aux_layers, overrides: dict | None = None) -> DraftConfig:
        """Head shape of the verifier (an HF config), with ``overrides`` (conf/model ``draft_head``) on top."""
        heads = hf_config.num_attention_heads
        theta, scaling = rope_settings(hf_config)
        values = dict(
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
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
