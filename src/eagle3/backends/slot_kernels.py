"""The decode-attention kernels of slot decoding (``slots``), and the probe that picks one.

    out = split_attention(query, keys, values, used, scale)       # query [n, heads, D] -> [n, heads, D]
    fastest_kernel(model)                                          # the first of KERNELS that runs here

One query per row attends over the row's first ``used[row]`` keys of a packed cache [n, length,
kv_heads, D]: ``split`` (Triton, split_attention.py), ``flash`` (flash attention's varlen kernel) or
``masked`` (SDPA over whole rows, anywhere). Off CUDA the packed kernels fall back to ``masked``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from eagle3.lm.spec import attention_shape

log = logging.getLogger(__name__)

KERNELS = ("split", "flash", "masked")  # decode attention, fastest first (docs/benchmarks.md measures them)


def whole_row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
    """The ``masked`` kernel: one query per row over its whole row, masked (SDPA): query [n, heads, D],
    keys/values [n, kv_heads, length, D], mask [n, 1, 1, length] -> [n, heads, D]."""
    n, kv_heads, _, head_dim = keys.shape
    grouped = query.reshape(n, kv_heads, -1, head_dim)  # one query a row: a kv head's query heads act as its queries
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale).reshape(n, -1, head_dim)


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor, scale) -> torch.Tensor:
    """One query per row over the row's first ``used[row]`` keys of a packed cache, masked: query [n, heads, D],
    keys/values [n, length, kv_heads, D] -> [n, heads, D] (the packed kernels off CUDA)."""
    mask = (torch.arange(keys.shape[1], device=keys.device)[None] < used[:, None])[:, None, None, :]  # [n, 1, 1, length]
    return whole_row_attention(query, keys.transpose(1, 2), values.transpose(1, 2), mask, scale)


def varlen_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor, scale,
                     starts: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``masked_attention`` by flash attention's varlen kernel on CUDA. ``starts`` = (row_starts,
    key_starts): row b's keys start at ``key_starts[b]`` (b x length) of the flattened cache and it
    reads ``used[b]`` of them (int32, as are ``row_starts``, 0..n: one query a row)."""
    if not query.is_cuda:
        return masked_attention(query, keys, values, used, scale)
    row_starts, key_starts = starts
    return torch.ops.aten._flash_attention_forward(
        query.contiguous(), keys.flatten(0, 1), values.flatten(0, 1), row_starts, key_starts, 1, keys.shape[1], 0.0, False, False,
        scale=scale, seqused_k=used)[0]


def split_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, used: torch.Tensor, scale) -> torch.Tensor:
    """``masked_attention`` by the Triton kernels of split_attention.py on CUDA."""
    if not query.is_cuda:
        return masked_attention(query, keys, values, used, scale)
    from eagle3.backends.split_attention import decode_attention  # imports triton: CUDA hosts only

    return decode_attention(query, keys, values, used, scale)


@functools.cache
def kernel_runs(kernel: str, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``kernel`` runs on ``device`` for this dtype and head shape: one call on a tiny cache, once a process
    (both packed kernels take fp16/bf16 on CUDA; flash needs an Ampere or newer GPU, split Triton and a
    power-of-two head_dim)."""
    if kernel == "masked":
        return True
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):  # fp32 stays exact: masked SDPA
        return False
    query = torch.zeros(2, heads, head_dim, dtype=dtype, device=device)
    keys = torch.zeros(2, 16, kv_heads, head_dim, dtype=dtype, device=device)
    used = torch.tensor([1, 16], dtype=torch.int32, device=device)
    try:
        if kernel == "split":
            split_attention(query, keys, keys, used, 1.0)
        else:
            starts = torch.arange(3, dtype=torch.int32, device=device)
            varlen_attention(query, keys, keys, used, 1.0, (starts, starts * 16))
        return True
    except Exception as reason:  # noqa: BLE001 (an unsupported GPU, dtype or shape, or no Triton: the next kernel)
        log.info("slots: decode kernel %s does not run here (%s: %s)", kernel, type(reason).__name__, reason)
        return False


def fastest_kernel(model) -> str:
    """The first of KERNELS that runs for this verifier on its device."""
    shape = attention_shape(model.config.get_text_config())
    return next(k for k in KERNELS if kernel_runs(k, model.device, model.dtype, *shape))
