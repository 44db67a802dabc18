"""Static-shape decoding steps, replayed as CUDA graphs on a GPU: how SGLang and vLLM serve a drafter.

    graphs = DecodeGraphs(prompt_tokens=512, max_new_tokens=64, capture=True)   # eager: capture=False
    target = Target(verifier=verifier, layer_ids=taps, eos_ids=eos, graphs=graphs)   # eagle3.decoding.speculative
    out = speculative_decode(target, EagleProposer(drafter, shape, graphs), prompts, 64)

Why: a decoding forward of a small verifier is host-bound when eager (SmolLM2-135M at batch 1 on an
H200: 34 ms per forward for 2.3 ms of GPU work, 3.3 ms as a CUDA graph), and so is every draft
step; the speedup a user sees from an engine is between graph-replayed steps. A graph replays
fixed kernels on fixed addresses, so what a step reads and writes lives in preallocated buffers:

- the verifier's KV cache (``ColumnCache``): [B, nkv, L, hd] per layer, where the forward over Q
  new columns writes at the columns ``write_at`` [Q] (S..S+Q-1, S = columns so far). Columns only
  grow, as in the eager cache, but none is ever removed: a finished row stays in the batch (what
  it decodes is no longer read) and a column no row accepted stays masked. L = the
  longest prompt + max_new_tokens * Q (every round adds Q columns and at least one token).
  A forward reads only the first W columns (``window``: S + Q rounded up to a power of two, at
  least MIN_WINDOW), so its attention costs what the batch has written, not what it might: a
  tree's L is 16 columns per new token.
- the verifier's attention (``grouped_query_attention``): a kv head's query heads stacked as its
  queries, so SDPA reads each cached key once. transformers' SDPA path copies every key and value
  per query head when a mask is given (``repeat_kv``), and decoding always gives one.
- the drafter's context cache (``StaticDraftCache``), the same way; every context step after the
  prompt's covers num_steps + 1 rows (the longest path), its pad rows masked.

One graph per (rows B, block Q, window W) for the verifier and per (drafter, B, tree shape) for the drafter's
``propose`` (its context step and every tree step, one replay), captured at the first call,
reused across batches of the same size (the buffers belong to ``DecodeGraphs``, not to one
decode); the prefill and the drafter's first context step (the prompt's length) stay eager.
With ``capture=False`` the same static buffers run eagerly: the CPU tests of this layout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from eagle3.decoding.batch import Batch, decoder_forward
from eagle3.decoding.tree import DraftBatchCache


COLUMN_MULTIPLE = 64
MIN_WINDOW = 256  # the narrowest window a verifier forward reads (``ColumnCache.window``)
ATTENTION = "eagle3_decode"  # ``grouped_query_attention``'s name in transformers' AttentionInterface


def grouped_query_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor,
                            **kwargs) -> tuple[Tensor, None]:
    """SDPA with each kv head's query heads stacked as its queries: query [B, H, Q, D], key/value
    [B, nkv, W, D], attention_mask [B, 1, Q, W] (additive) -> ([B, Q, H, D], None).

    The same attention as transformers' SDPA path, without its copy of every key and value per query
    head (kv head i serves heads i * H / nkv ...; the mask repeats per stacked query). Softcapping,
    sinks and dropout, which plain SDPA lacks, go to transformers' own. ``scaling`` and ``dropout``
    come by keyword, as transformers' attention interface passes them.
    """
    scaling = kwargs.get("scaling")
    if kwargs.get("dropout", 0.0) or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    B, heads, Q, D = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    repeat = heads // kv_heads
    grouped = query.reshape(B, kv_heads, repeat * Q, D)
    mask = attention_mask[:, :, None].expand(-1, -1, repeat, -1, -1).reshape(B, attention_mask.shape[1], repeat * Q, width)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, heads, Q, D).transpose(1, 2), None


AttentionInterface.register(ATTENTION, grouped_query_attention)


@contextmanager
def attending_grouped(decoder) -> Iterator[None]:
    """The decoder's layers attend with ``grouped_query_attention`` inside the block (and as before after)."""
    config = decoder.config.get_text_config()
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


class StepGraph:
    """A function of fixed-shape tensors, captured once as a CUDA graph and replayed (``capture``), or eager.

    A call copies its inputs into the graph's input buffers, replays, and returns clones of the
    outputs (the next replay overwrites them). The function may write state buffers (KV caches):
    the warm-up runs before capture write the same places the first replay writes again.
    """

    def __init__(self, fn: Callable[..., tuple[Tensor, ...]], capture: bool):
        self.fn, self.capture = fn, capture
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        if not self.capture:
            self.inputs = inputs
            return self.fn(*inputs)
        if self.graph is None:
            self.record(inputs)
        for buffer, x in zip(self.inputs, inputs):
            buffer.copy_(x)
        self.graph.replay()
        return tuple(x.clone() for x in self.outputs)

    def seconds(self, calls: int = 20) -> float:
        """The time of one call on the last inputs (replayed ``calls`` times; it rewrites what that call wrote)."""
        run = self.graph.replay if self.capture else lambda: self.fn(*self.inputs)
        run()
        synchronize = torch.cuda.synchronize if self.capture else (lambda: None)
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        synchronize()
        return (time.perf_counter() - start) / calls

    def record(self, inputs: tuple[Tensor, ...]) -> None:
        self.inputs = tuple(x.clone() for x in inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs advises
            for _ in range(2):
                self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(*self.inputs)
        self.graph, self.outputs = graph, outputs  # only a capture that succeeded is ever replayed


class ColumnCache:
    """The verifier's KV cache in preallocated buffers [B, nkv, L, hd] per layer (see the module docstring).

    It speaks the part of transformers' cache protocol a decoder layer uses (``update`` from each
    attention layer, ``get_seq_length``), so no cache class of a given transformers version is
    subclassed; the attention mask, always given as 4D, covers all L columns.
    """

    def __init__(self, length: int):
        self.length = length  # L: columns per row
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.write_at: Tensor | None = None  # [Q] the columns the running forward writes
        self.width = length  # W: the columns the running forward reads (``window``)
        self.columns = 0  # S: columns written so far (host side)

    def window(self, columns: int) -> int:
        """W for a forward whose last column is ``columns``: a power of two, at least MIN_WINDOW, at most L
        (few shapes, so few graphs; a forward reads less than twice the columns written)."""
        return min(self.length, max(MIN_WINDOW, 1 << (columns - 1).bit_length()))

    def windows(self) -> list[int]:
        """Every W a forward can read, narrowest first (e.g. L 1,088: 256, 512, 1,024, 1,088)."""
        return [w for w in (MIN_WINDOW << i for i in range(self.length.bit_length())) if w < self.length] + [self.length]

    def saved(self, columns: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Copies of every layer's keys and values at ``columns`` [n] (``restore`` puts them back)."""
        return [(k.index_select(2, columns), v.index_select(2, columns)) for k, v in zip(self.keys, self.values)]

    def restore(self, columns: Tensor, saved: list[tuple[Tensor, Tensor]]) -> None:
        for (k, v), (old_k, old_v) in zip(zip(self.keys, self.values), saved):
            k.index_copy_(2, columns, old_k)
            v.index_copy_(2, columns, old_v)

    def load(self, prefilled: DynamicCache) -> None:
        """Start a batch from ``prefill``'s cache: its S columns, the rest left as they are (masked)."""
        if not self.keys:
            for layer in prefilled.layers:
                B, nkv, _, hd = layer.keys.shape
                self.keys.append(layer.keys.new_zeros(B, nkv, self.length, hd))
                self.values.append(layer.values.new_zeros(B, nkv, self.length, layer.values.shape[-1]))
        self.columns = prefilled.layers[0].keys.shape[2]
        for buffer, values, layer in zip(self.keys, self.values, prefilled.layers):
            buffer[:, :, : self.columns].copy_(layer.keys)
            values[:, :, : self.columns].copy_(layer.values)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        self.keys[layer_idx].index_copy_(2, self.write_at, key)
        self.values[layer_idx].index_copy_(2, self.write_at, value)
        return self.keys[layer_idx][:, :, : self.width], self.values[layer_idx][:, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.columns


class StaticDraftCache(DraftBatchCache):
    """The drafter's context cache in preallocated buffers [B, nkv, L, hd]; a context step writes at ``write_at`` [T]."""

    def __init__(self, length: int):
        self.length = length
        self.write_at: Tensor | None = None
        self.columns = 0

    def reset(self) -> None:
        """A new batch: no context column holds a real row (the buffers' old keys are masked)."""
        self.columns = 0
        if self.valid is not None:
            self.valid.zero_()
        self.chain_k = self.chain_v = None

    def next_columns(self, count: int, device: torch.device) -> Tensor:
        """The columns of the next context step of ``count`` rows: [count]."""
        if self.columns + count > self.length:
            raise ValueError(f"the drafter's static cache holds {self.length} columns, {self.columns + count} needed")
        self.write_at = torch.arange(self.columns, self.columns + count, device=device)
        self.columns += count
        return self.write_at

    def add_context(self, k: Tensor, v: Tensor) -> Tensor:
        if self.k is None:
            B, nkv, _, hd = k.shape
            self.k, self.v = k.new_zeros(B, nkv, self.length, hd), v.new_zeros(B, nkv, self.length, hd)
            self.valid = torch.zeros(B, self.length, dtype=torch.bool, device=k.device)
        self.k.index_copy_(2, self.write_at, k)
        self.v.index_copy_(2, self.write_at, v)
        self.valid.index_copy_(1, self.write_at, self.incoming)
        self.chain_k = self.chain_v = None
        columns = torch.arange(self.length, device=k.device)
        causal = columns <= self.write_at[:, None]  # [T, L]
        return (causal & self.valid[:, None, :])[:, None, None]  # [B, 1, 1, T, L]


class DecodeGraphs:
    """The static buffers and graphs of every (batch rows, block) shape one ``evaluate`` run decodes."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, capture: bool):
        self.prompt_tokens, self.max_new_tokens, self.capture = prompt_tokens, max_new_tokens, capture
        self.verifier_caches: dict[tuple[int, int], ColumnCache] = {}
        self.draft_caches: dict[tuple, StaticDraftCache] = {}
        self.graphs: dict[tuple, StepGraph] = {}

    def columns(self, block: int) -> int:
        """L of a cache whose every round adds ``block`` columns: the longest prompt, then one round per token
        (rounded up to COLUMN_MULTIPLE: attention kernels want aligned mask rows)."""
        return -(-(self.prompt_tokens + self.max_new_tokens * block) // COLUMN_MULTIPLE) * COLUMN_MULTIPLE

    def verifier_cache(self, rows: int, block: int) -> ColumnCache:
        key = (rows, block)
        if key not in self.verifier_caches:
            self.verifier_caches[key] = ColumnCache(self.columns(block))
        return self.verifier_caches[key]

    def draft_cache(self, rows: int, shape) -> StaticDraftCache:
        key = (rows, shape)
        if key not in self.draft_caches:
            self.draft_caches[key] = StaticDraftCache(self.columns(shape.num_steps + 1))
        cache = self.draft_caches[key]
        cache.reset()
        return cache

    def step(self, key: tuple, fn: Callable[..., tuple[Tensor, ...]]) -> StepGraph:
        """The graph of ``key``, made from ``fn`` at the first call (later calls' ``fn`` are the same
        computation on the same buffers, so the first one's capture serves them)."""
        if key not in self.graphs:
            self.graphs[key] = StepGraph(fn, self.capture)
        return self.graphs[key]

    def static_batch(self, prefilled: Batch, block: int) -> Batch:
        """A copy of ``prefill``'s batch in the static cache of its row count, for forwards of ``block`` columns."""
        cache = self.verifier_cache(len(prefilled.root), block)
        cache.load(prefilled.cache)
        return Batch(cache=cache, valid=prefilled.valid.clone(), positions=prefilled.positions.clone(),
                     root=prefilled.root.clone(), length=prefilled.length.clone(), graphs=self)

    def verifier_forward(self, decoder, cache: ColumnCache, input_ids: Tensor, positions: Tensor, masks,
                         layer_ids) -> tuple[Tensor, Tensor]:
        """``batch.decoder_forward`` over input_ids [B, Q] written at the cache's next Q columns, reading its
        first W (``ColumnCache.window``), captured per (B, Q, W). ``masks`` [B, 1, Q, S + Q] (or a dict of
        them by layer type) are padded to W columns."""
        B, Q = input_ids.shape
        if cache.columns + Q > cache.length:
            raise ValueError(f"the verifier's static cache holds {cache.length} columns, {cache.columns + Q} needed")
        width = cache.window(cache.columns + Q)
        kinds = None if isinstance(masks, Tensor) else sorted(masks)
        flat = [masks] if kinds is None else [masks[kind] for kind in kinds]
        flat = [F.pad(m, (0, width - m.shape[-1]), value=torch.finfo(m.dtype).min) for m in flat]  # [B, 1, Q, W]
        write_at = torch.arange(cache.columns, cache.columns + Q, device=input_ids.device)
        cache.columns += Q
        key = self.verifier_key(B, Q)
        if (*key, width) not in self.graphs:
            self.make_windows(key, cache, lambda width: self.window_forward(decoder, cache, width, kinds, layer_ids), flat)
        return self.graphs[(*key, width)](input_ids, positions, write_at, *flat)

    @staticmethod
    def window_forward(decoder, cache: ColumnCache, width: int, kinds: list | None,
                       layer_ids) -> Callable[..., tuple[Tensor, Tensor]]:
        """The verifier's forward reading ``width`` columns, as a function of its tensors (a graph's ``fn``)."""

        def forward(input_ids: Tensor, positions: Tensor, write_at: Tensor, *flat: Tensor) -> tuple[Tensor, Tensor]:
            cache.write_at, cache.width = write_at, width
            masks = flat[0] if kinds is None else dict(zip(kinds, flat))
            with attending_grouped(decoder):
                return decoder_forward(decoder, cache, input_ids, positions, masks, layer_ids)

        return forward

    def make_windows(self, key: tuple, cache: ColumnCache, forward_of: Callable[[int], Callable], masks: list[Tensor]) -> None:
        """The graph of every window of ``key`` = (verifier, B, Q) at once, at its first forward.

        Why all at once: a window first reached inside a timed decode would time its capture. Each
        graph is made on stand-in inputs (token 0 at position 0, every column visible) written at its
        window's last Q columns, whose keys and values are put back after (no graph reads columns
        it has not been given: they are masked until a forward writes them).
        """
        _, B, Q = key
        device = masks[0].device
        for width in cache.windows():
            if (*key, width) in self.graphs:
                continue
            write_at = torch.arange(width - Q, width, device=device)
            kept = cache.saved(write_at)
            stand_ins = [torch.zeros(B, 1, Q, width, dtype=m.dtype, device=device) for m in masks]
            zeros = torch.zeros(B, Q, dtype=torch.long, device=device)
            self.step((*key, width), forward_of(width))(zeros, zeros, write_at, *stand_ins)
            cache.restore(write_at, kept)

    @staticmethod
    def verifier_key(rows: int, block: int) -> tuple:
        """The graphs of the verifier's forward over ``block`` columns of ``rows`` rows (one per window)."""
        return "verifier", rows, block

    @staticmethod
    def draft_key(drafter, shape, rows: int) -> tuple:
        """The graph of ``drafter``'s proposal of ``shape`` for ``rows`` rows (its context step of num_steps + 1 rows)."""
        return "draft", id(drafter), shape, rows

    def replay_seconds(self, key: tuple) -> float | None:
        """The time of one call of the graph ``key`` (``draft_key``; of ``verifier_key``'s, the widest window's);
        None if no decode has made it yet."""
        made = [k for k in self.graphs if k[: len(key)] == key]
        return self.graphs[max(made)].seconds() if made else None
