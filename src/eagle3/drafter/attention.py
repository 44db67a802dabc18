"""The draft layer's KV cache and its attention over it: context keys, chain keys, packed documents.

    cache = KVCache()                                          # or KVCache(starts=...): causal, packed
    last = cache.add_context(k, v)                             # or cache.add_chain(k, v, rows)
    out = cached_attention(q, cache, last)                     # [B, nh, R, hd]

Why: training-time test and speculative decoding both run the drafter over a context plus a few
chained steps; this module is who sees what, written once. ``model.py``'s ``Attention`` projects
q/k/v and calls it.

A ``KVCache`` holds keys/values (RoPE applied) of two kinds:

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
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.drafter.fused import fused_when_training_on_gpu


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


SCORES_LIMIT = 2**28  # fp32 scores (1 GiB) that one matmul of ``masked_attention`` may hold; more go by query rows


def masked_attention(q: Tensor, k: Tensor, v: Tensor, last: Tensor, first: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [B, nh, R, hd] over keys first[b, r]..last[r] of k, v [B, nkv, S, hd] -> (out [B, nh, R, hd], lse [B, nh, R] fp32).

    ``first`` [B, R] (default 0) is where the query's document begins; every query sees at least
    its own key (first <= last), so no row of scores is all -inf. ``last`` may instead be a bool
    mask of the visible keys, [B, 1, 1, R, S] (batched decoding, where each sequence of the batch
    has its own holes: padding, rejected drafts).

    Scores of more than ``SCORES_LIMIT`` elements are computed a slice of query rows at a time (each row's softmax is
    its own, so the result is the same): the prefill of 64 prompts of 2,048 tokens would otherwise hold three copies of
    [64, nh, 2048, 2304] fp32 scores, 17.6 GiB each for SmolLM2, more than an H100 had left beside the verifier.
    """
    B, nh, R, _ = q.shape
    rows = max(1, SCORES_LIMIT // (B * nh * k.shape[2]))
    if R <= rows:
        return rows_attention(q, k, v, last, first)
    parts = [rows_attention(q[:, :, i:i + rows], k, v, last[..., i:i + rows, :] if last.dtype == torch.bool else last[i:i + rows],
                            None if first is None else first[:, i:i + rows]) for i in range(0, R, rows)]
    return torch.cat([out for out, _ in parts], 2), torch.cat([lse for _, lse in parts], 2)


def rows_attention(q: Tensor, k: Tensor, v: Tensor, last: Tensor, first: Tensor | None) -> tuple[Tensor, Tensor]:
    """``masked_attention`` of every query row at once."""
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


def flex_attention_kernel():
    """FlexAttention, compiled: uncompiled, it materialises the scores. Inside a step compiled as a
    whole (``train.compile``) the step's compilation takes it in as it is."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


BLOCK = 128  # FlexAttention's default tile: rows and keys are masked by blocks of 128


def document_block_mask(starts: Tensor):
    """FlexAttention mask of packed rows: query q sees keys starts[b, q]..q (its own document, causal).

    The same tensors as ``create_block_mask`` builds for this mask_mod, from the documents' starts alone. Why:
    ``create_block_mask`` evaluates the mask at every (query, key) pair and orders the blocks with a sort; inside the
    compiled step, Triton took 31 + 15 s to build that sort's two kernels (one H100, the 10k shape), most of the
    first step's wait. Here a block's fate follows from the starts of its first and last rows: starts never decrease
    along a row and ``starts[q] <= q``, so block (i, j) holds a visible pair when j <= i and j's last key reaches the
    first row's start, and is full when j < i, j's first key is at or after the last row's start and no row or key
    of it is padding.
    """
    from torch.nn.attention.flex_attention import BlockMask

    B, T = starts.shape
    blocks = torch.arange(-(-T // BLOCK), device=starts.device)
    first_row, last_row = blocks * BLOCK, (blocks * BLOCK + BLOCK - 1).clamp(max=T - 1)
    q, kv = blocks[:, None], blocks[None, :]  # [n, 1] query blocks, [1, n] key blocks
    seen = (kv <= q) & (kv * BLOCK + BLOCK - 1 >= starts[:, first_row, None])  # [B, n, n]
    full = (kv < q) & (kv * BLOCK >= starts[:, last_row, None]) & (first_row + BLOCK <= T)[:, None]
    partial = seen & ~full
    kv_num, kv_indices = ordered_blocks(partial)
    full_kv_num, full_kv_indices = ordered_blocks(full)
    q_num, q_indices = ordered_blocks(partial.transpose(-2, -1))
    full_q_num, full_q_indices = ordered_blocks(full.transpose(-2, -1))
    return BlockMask(seq_lengths=(T, T), kv_num_blocks=kv_num, kv_indices=kv_indices, full_kv_num_blocks=full_kv_num,
                     full_kv_indices=full_kv_indices, q_num_blocks=q_num, q_indices=q_indices, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_indices, BLOCK_SIZE=(BLOCK, BLOCK),
                     mask_mod=lambda b, h, q, k: (q >= k) & (k >= starts[b, q]))


def ordered_blocks(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Block flags [B, n, n] -> (count per row [B, 1, n], the flagged columns first, then the others, each in
    column order [B, 1, n, n]), int32: a stable descending argsort of the flags, as ``create_block_mask``'s,
    by counting instead of sorting.

    Worked example: flags [0, 1, 1, 0] -> count 2, columns [1, 2, 0, 3].
    """
    flags = dense.int()
    count = flags.sum(-1, dtype=torch.int32)
    slot = torch.where(dense, flags.cumsum(-1) - 1, count[..., None] + (1 - flags).cumsum(-1) - 1)  # where each column goes
    columns = torch.arange(dense.shape[-1], device=dense.device, dtype=torch.int32).expand_as(slot)
    indices = torch.empty_like(columns).scatter_(-1, slot, columns)
    return count.unsqueeze(1), indices.unsqueeze(1)


def fused_causal_attention(q: Tensor, k: Tensor, v: Tensor, block_mask) -> tuple[Tensor, Tensor]:
    """Causal q [B, nh, T, hd] over k, v [B, nkv, T, hd] within documents, in one kernel (FlexAttention).

    Same contract as ``masked_attention`` with last = 0..T-1 and first = the ``document_block_mask``
    starts. The log-sum-exp is differentiable, which the chain keys of training-time test need:
    they are merged in outside the kernel.
    """
    from torch.nn.attention.flex_attention import AuxRequest

    # return_aux, not the deprecated return_lse: its once-only warning adds to a global set, which a compiled
    # step guards on, so the step compiled twice (one H200: a recompile in the log; ~38 s of the recorded 10k run)
    out, aux = flex_attention_kernel()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                                       return_aux=AuxRequest(lse=True))
    return out, aux.lse.float()


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
