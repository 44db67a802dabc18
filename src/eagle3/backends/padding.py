"""Left-padded token batches: the shapes the local backend's eager path and its slot path both build."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_width(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def left_pad(rows: Sequence[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (input_ids [B, T], attention_mask [B, T]), padded on the left to T = a multiple of ``multiple``."""
    width = padded_width(max(len(row) for row in rows), multiple)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        attention_mask[b, width - len(row) :] = 1
    return input_ids, attention_mask
