"""The verifier's side of a decoding batch: its KV cache, what each column holds, and the masks built from it.

    batch = Batch(cache=new_cache(), valid=valid, positions=positions, root=root, length=length)   # ``speculative.prefill``'s
    hidden, features = forward_verifier(verifier, batch, ids, positions, visible, layer_ids)
    drop_rejected(batch, block=4, kept=torch.tensor([0, 1]))       # columns no row accepted leave
    keep_rows(batch, torch.tensor([0, 2]))                          # finished rows leave

Why: ``eagle3.decoding.speculative`` decodes several prompts at once, each row accepting its own
drafts. Every forward appends its columns for every row, and a bool per column says whether it
holds an accepted token of that row (``Batch.valid``; not padding, not a rejected draft). Attention
masks are built from it (``attention_masks``), so no column needs to be cropped or reordered for
the others' sake, whatever each row accepted, and sliding-window layers stay exact (their window
is a distance between positions, applied in the mask). Each column also records its position in
its sequence; RoPE and the window use positions, never column indices. Decoding eagerly, the
columns no row accepted and the rows that finished are taken out all the same (``drop_rejected``,
``keep_rows``), only so later forwards stop paying for them; ``eagle3.decoding.graphed``'s static
cache keeps both, masked.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from eagle3.lm.spec import tapped_features


@dataclass
class Batch:
    """The verifier's side of a batch: its KV cache and what each column holds."""

    cache: DynamicCache
    valid: Tensor  # [B, S] bool: the column holds an accepted token of this row
    positions: Tensor  # [B, S] position of each column in its row's sequence
    root: Tensor  # [B] the last verified token, input of the next forward
    length: Tensor  # [B] the root's position
    graphs: object = None  # ``graphed.DecodeGraphs`` when the cache is its static one (rows and columns never leave)


def cache_kwargs(verifier, cache: DynamicCache) -> dict:
    """The KV-cache arguments of the verifier's forward: ``cache`` in recent transformers 5, else (older 5.x,
    remote code) ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def new_cache() -> DynamicCache:
    """A verifier KV cache that keeps every column of every layer.

    ``DynamicCache(config=...)`` gives sliding-window layers (Mistral, hybrid families) a cache that
    keeps only the last window - 1 keys: it cannot hold columns that later turn out rejected, and
    transformers refuses to crop it once the window is full. Without a config every layer keeps all
    its columns; a sliding layer still sees only its window, through the masks of ``attention_masks``.
    """
    return DynamicCache()


def sliding_windows(config) -> dict[str | None, int | None]:
    """Window per mask the verifier's forward takes: {None: w} for one mask, {layer type: w} for several.

    Hybrid families (``layer_types`` with sliding and full layers) take a dict of masks keyed by
    layer type; the others one mask, windowed when ``sliding_window`` applies to every layer.
    """
    config = config.get_text_config()
    types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if len(types) > 1:
        return {kind: window if kind == "sliding_attention" else None for kind in types}
    if types and types != {"sliding_attention"}:
        window = None  # e.g. Qwen2: sliding_window set, every layer full
    return {None: window}


def attention_masks(config, visible: Tensor, cache_positions: Tensor, block_positions: Tensor, dtype: torch.dtype):
    """Additive masks [B, 1, Q, S + Q] of a forward over Q new columns: the attention_mask argument.

    visible [B, Q, S + Q]: which valid cache columns each query may see, then which new columns
    (causal, or ancestors in a tree); positions [B, S] and [B, Q] for the windows.
    """
    distance = block_positions[:, :, None] - torch.cat([cache_positions, block_positions], 1)[:, None, :]
    masks = {}
    for kind, window in sliding_windows(config).items():
        seen = visible & (distance < window) if window else visible
        masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)[:, None]
    return masks.pop(None) if None in masks else masks


def forward_verifier(verifier, batch: Batch, input_ids: Tensor, positions: Tensor, visible: Tensor,
                     layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The verifier's decoder over input_ids [B, Q] appended to the batch's cache, each seeing the columns of
    ``visible`` [B, Q, S + Q] (``attention_masks``): (last hidden states [B, Q, H], the lm_head's input;
    features [B, Q, 3H]).

    The lm_head is left to the caller, which needs it for a few columns only (``greedy_tokens``).
    The new columns are recorded as not (yet) valid.
    """
    decoder = verifier.base_model
    dtype = verifier.get_input_embeddings().weight.dtype
    masks = attention_masks(verifier.config, visible, batch.positions, positions, dtype)
    if batch.graphs is not None:
        hidden, features = batch.graphs.verifier_forward(decoder, batch.cache, input_ids, positions, masks, layer_ids)
    else:
        hidden, features = decoder_forward(decoder, batch.cache, input_ids, positions, masks, layer_ids)
    batch.valid = torch.cat([batch.valid, torch.zeros_like(input_ids, dtype=torch.bool)], 1)
    batch.positions = torch.cat([batch.positions, positions], 1)
    return hidden, features


def decoder_forward(decoder, cache, input_ids: Tensor, positions: Tensor, masks, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The verifier's decoder over input_ids [B, Q] on ``cache``: (last hidden states [B, Q, H], features [B, Q, 3H])."""
    out = decoder(input_ids=input_ids, position_ids=positions, attention_mask=masks, output_hidden_states=True,
                  **cache_kwargs(decoder, cache))
    return out.last_hidden_state, tapped_features(out.hidden_states, layer_ids)


def drop_rejected(batch: Batch, block: int, kept: Tensor) -> None:
    """Remove the last ``block`` columns that no row accepted; ``kept`` [n]: the others' block indices, ascending.

    Why: such a column is masked out of every later forward, yet attention, its mask and the
    cache's growth pay for it in each one; with 16-token trees at τ ≈ 1 the cache would be mostly
    such columns by the 64th token. The kept columns move down in place (no copy of the whole
    cache) and every layer's cache is cut to length, as ``DynamicCache.crop`` does.
    """
    start, n = batch.valid.shape[1] - block, len(kept)
    if n == block:
        return
    index = start + kept

    def keep(x: Tensor) -> Tensor:  # [..., S, d] or [B, S]
        dim = -2 if x.dim() > 2 else -1
        x.narrow(dim, start, n).copy_(x.index_select(dim, index))
        return x.narrow(dim, 0, start + n)

    for layer in batch.cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = keep(layer.keys), keep(layer.values)
    batch.valid, batch.positions = keep(batch.valid), keep(batch.positions)


def keep_rows(batch: Batch, rows: Tensor) -> None:
    """Keep only ``rows`` [R] of the batch (the others finished): every layer's cache and the column records.

    Why: a finished prompt would otherwise ride along in every later forward; on a CPU, where the
    verify forwards of a few rows are compute-bound, a batch whose prompts stop at 10 and 64 tokens
    pays for both rows until the end.
    """
    for layer in batch.cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    batch.valid, batch.positions, batch.root, batch.length = (x[rows] for x in (batch.valid, batch.positions, batch.root, batch.length))
