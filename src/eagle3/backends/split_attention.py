"""Decode attention split along the keys (flash decoding), in Triton: the ``split`` kernel of slot decoding.

One query token per row attends over the row's first ``used[row]`` keys of a packed cache
[rows, length, kv_heads, head_dim]. Why not flash attention's varlen kernel: it gives each (row,
query head) one program that walks the row's keys alone, in tiles of 128 queries of which decoding
fills one. Here a program takes one (row, kv head, slice of SPLIT keys): the query heads that share
the kv head read its keys once, together, and a long row's slices are read by several programs at
once; a slice past a row's used keys does nothing. A second kernel merges each (row, head)'s slices
by their log-sum-exp. Scores, softmax and sums in fp32; the grid depends only on the cache's shape,
so a CUDA graph captures it once.

Imported on CUDA hosts only (it needs Triton); ``slots.split_attention`` is the entry point.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # keys a program reads at once
SPLIT = 256  # keys a program attends over at most (a multiple of BLOCK)
MIN_GROUP = 16  # tl.dot's smallest side: a kv head's query heads are padded to it


@triton.jit
def _attend_slice(query, keys, values, used, parts, lses, scale,
                  q_row, q_head, k_row, k_pos, k_head, p_row, p_head, p_split, l_row, l_head,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                  SPLIT: tl.constexpr):
    """Program (row, kv head, slice): softmax-weighted values of the slice's keys for the GROUP query heads of
    the kv head, normalised within the slice, and the slice's log-sum-exp of scores (for the merge)."""
    row, kv_head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # int64: big caches
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, tl.load(used + row))
    if start < end:  # a slice past the row's keys writes nothing: the merge skips it
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM)
        heads = kv_head * GROUP + group
        real = group < GROUP
        q = tl.load(query + row * q_row + heads[:, None] * q_head + dims[None, :], mask=real[:, None], other=0.0)
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max score per head
        total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - best)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        for block in range(SPLIT // BLOCK):  # the first block holds a key (start < end); later ones may hold none
            positions = start + block * BLOCK + tl.arange(0, BLOCK)
            inside = positions < end
            offsets = row * k_row + positions[:, None] * k_pos + kv_head * k_head + dims[None, :]
            k = tl.load(keys + offsets, mask=inside[:, None], other=0.0)
            scores = tl.where(inside[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))  # [GROUP_PAD, BLOCK]
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            kept = tl.exp(best - new_best)  # 0 on the first block (best is -inf), 1 on an empty one
            total = total * kept + tl.sum(weights, 1)
            v = tl.load(values + offsets, mask=inside[:, None], other=0.0)
            acc = acc * kept[:, None] + tl.dot(weights.to(v.dtype), v)
            best = new_best
        tl.store(parts + row * p_row + heads[:, None] * p_head + split * p_split + dims[None, :], acc / total[:, None],
                 mask=real[:, None])
        tl.store(lses + row * l_row + heads * l_head + split, best + tl.log(total), mask=real)


@triton.jit
def _merge_slices(parts, lses, used, out, p_row, p_head, p_split, l_row, l_head, o_row, o_head,
                  SPLIT: tl.constexpr, SPLITS_PAD: tl.constexpr, DIM: tl.constexpr):
    """Program (row, head): the slices' outputs weighted by exp(their log-sum-exp), the row's attention output."""
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM)
    present = splits * SPLIT < tl.load(used + row)
    lse = tl.load(lses + row * l_row + head * l_head + splits, mask=present, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # slice 0 is always present (used >= 1)
    slices = tl.load(parts + row * p_row + head * p_head + splits[:, None] * p_split + dims[None, :],
                     mask=present[:, None], other=0.0)
    merged = tl.sum(slices * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out + row * o_row + head * o_head + dims, merged.to(out.dtype.element_ty))


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [n, heads, D], keys/values [n, length, kv_heads, D] (a view of the cache's first n rows; D a power
    of two, keys and values strided alike), used [n] (1 <= used <= length) -> [n, heads, D]."""
    n, heads, dim = query.shape
    length, kv_heads = keys.shape[1], keys.shape[2]
    if dim & (dim - 1) or keys.stride() != values.stride() or query.stride(2) != 1 or keys.stride(3) != 1:
        raise ValueError(f"split attention needs a power-of-two head_dim and packed keys/values (head_dim {dim})")
    group, splits = heads // kv_heads, triton.cdiv(length, SPLIT)
    parts = torch.empty(n, heads, splits, dim, dtype=torch.float32, device=query.device)
    lses = torch.empty(n, heads, splits, dtype=torch.float32, device=query.device)
    out = torch.empty(n, heads, dim, dtype=query.dtype, device=query.device)
    _attend_slice[(n, kv_heads, splits)](
        query, keys, values, used, parts, lses, scale, query.stride(0), query.stride(1), keys.stride(0), keys.stride(1),
        keys.stride(2), parts.stride(0), parts.stride(1), parts.stride(2), lses.stride(0), lses.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_GROUP, triton.next_power_of_2(group)), DIM=dim, BLOCK=BLOCK, SPLIT=SPLIT)
    _merge_slices[(n, heads)](
        parts, lses, used, out, parts.stride(0), parts.stride(1), parts.stride(2), lses.stride(0), lses.stride(1),
        out.stride(0), out.stride(1), SPLIT=SPLIT, SPLITS_PAD=triton.next_power_of_2(splits), DIM=dim)
    return out
