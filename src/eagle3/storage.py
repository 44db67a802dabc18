"""The on-disk format of hidden states, shared by ``extract`` (writes) and ``data`` (reads).

A shard folder holds safetensors parts; each part is the concatenation of many samples along
the token axis:

    input_ids [N] int32, loss_mask [N] uint8,
    aux [N, 3H] and final [N, H] in bf16, or in float8_e4m3fn with
    aux_scale [N, 3] and final_scale [N, 1] float32 (one scale per token and per tapped layer).

A sample is the token range ``[offset, offset + length)`` of one part. This module is a
dependency of every ``extract`` stage (a change here re-extracts) and of ``train``, which reads it.
"""

from __future__ import annotations

import torch

from eagle3.common import UserError

STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G*H] -> (fp8 [T, G*H], scale [T, G] float32): one scale per token and per group.

    A group is one tapped layer's H values, so a layer with large activations does not cost the
    others their precision. ``x ≈ q * scale`` with a relative error ≤ 2^-4 plus scale·2^-10.
    """
    tokens, width = x.shape
    grouped = x.float().reshape(tokens, groups, width // groups)  # [T, G, H]
    scale = grouped.abs().amax(dim=-1) / FP8_MAX  # [T, G]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale works
    q = (grouped / scale[..., None]).to(torch.float8_e4m3fn).reshape(tokens, width)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(fp8 [T, G*H], scale [T, G]) -> float32 [T, G*H]."""
    tokens, width = q.shape
    grouped = q.float().reshape(tokens, scale.shape[1], width // scale.shape[1])  # [T, G, H]
    return (grouped * scale[..., None]).reshape(tokens, width)


def encode_states(name: str, x: torch.Tensor, dtype: str, groups: int) -> dict[str, torch.Tensor]:
    """The stored tensors of hidden states ``x`` [T, G*H]: ``{name}`` and, for fp8, ``{name}_scale``."""
    if dtype == "bfloat16":
        return {name: x.to(torch.bfloat16).contiguous()}
    if dtype == "float8_e4m3fn":
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}
    raise UserError(f"params.yaml: extract.dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")


def decode_states(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Inverse of ``encode_states``: float32 [T, G*H]."""
    scale = stored.get(f"{name}_scale")
    return stored[name].float() if scale is None else dequantize_fp8(stored[name], scale)


def read_rows(part, names: list[str], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows ``[start, stop)`` of the named tensors of an open part (only those bytes are read)."""
    keys = set(part.keys())
    return {key: part.get_slice(key)[start:stop] for key in names if key in keys}
