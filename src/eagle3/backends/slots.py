"""Decoding over a slot KV cache, each decode step replayed as a CUDA graph: the ``local`` backend on CUDA.

Why: eager transformers decoding is host-bound on a small verifier (SmolLM2-135M on an H200: 34 ms
of host time per step for 2.3 ms of GPU work, 1,223 kernel launches); the same step replayed as a
CUDA graph costs the host one launch.

How, in the verifier's own modules (any family whose attention goes through transformers'
``AttentionInterface``):

- a cache of ``slots`` rows x ``length`` positions per layer, [slots, kv_heads, length, head_dim],
  allocated once per group of requests; our attention function (registered as ``ATTENTION``)
  writes each row's keys and values at that row's own position and attends over the row, so a
  finished row can take a new prompt while the others decode (continuous batching) and every
  decode step has one shape: captured once per slot count as a CUDA graph;
- prefill: new prompts left padded, at most ``PREFILL_TOKENS`` padded tokens per forward, eager;
  the shift of ``Prefill`` moves each row's keys to positions 0.. in its slot;
- every ``SYNC_STEPS`` steps the host reads which rows finished (its only sync), hands their tokens
  over while the GPU runs the next steps, and refills free rows once enough are free (a prefill is an
  eager forward: batched so its launches are paid rarely); with no prompt left, live rows move to the
  front and the graph over fewer slots runs (the drain of the longest answers);
- a decode step's attention (``slot_kernels.KERNELS``, the first that runs here by default) reads each live row's
  used keys only: ``split`` (split_attention.py: Triton, the keys split across programs) or ``flash``
  (flash attention's varlen kernel) over a packed cache [slots, length, kv_heads, head_dim]; a finished
  row reads one key. ``masked`` (SDPA over whole rows, masked past each row's position) runs anywhere:
  the CPU, fp32, GPUs older than Ampere.

Requests are grouped by prompt width (``slot_groups.group_requests``): a group's cache is as long as its widest
prompt + max_new_tokens and has as many rows as ``batch_size`` and ``batch_tokens`` allow (the local
backend sizes the latter from the GPU memory free: ``cache_bytes_per_position``).

Greedy or sampled (``backends.sampling``: each row draws by its request's seed and the tokens it has, inside the
graph); a row ends at an EOS token or max_new_tokens, and the backend cuts stop strings afterwards as it does for
the eager path. Without CUDA (tests) the same steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from eagle3.backends.base import Request
from eagle3.backends.padding import left_pad
from eagle3.backends.sampling import GREEDY, Sampling
from eagle3.backends.slot_groups import Group
from eagle3.backends.slot_kernels import fastest_kernel, split_attention, varlen_attention, whole_row_attention

log = logging.getLogger(__name__)

ATTENTION = "eagle3_slots"  # our attention function's name in transformers' AttentionInterface
SYNC_STEPS = 16  # decode steps between two looks at which rows finished
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward
MIN_SLOTS = 16  # smallest graph the drain moves down to
REFILL_SHARE = 8  # refill when 1/REFILL_SHARE of the rows are free (or none is decoding)


@dataclass(frozen=True)
class Prefill:
    """What the attention writes during a prefill forward of ``n`` left-padded prompts of width T."""

    slots: torch.Tensor  # [n] the cache row each prompt goes to
    shift: torch.Tensor  # [n, T] the column of the padded chunk holding position j: row of length 2, T 4 -> [2, 3, 3, 3]


class SlotsCannotAttend(Exception):
    """Raised at a group's first forward, before any answer: the local backend decodes eagerly instead."""


class SlotCache:
    """Keys and values of every layer, allocated on first write: [slots, kv_heads, length, head_dim] each for
    the ``masked`` kernel, [slots, length, kv_heads, head_dim] (packed: each row's keys in a row) for the others.

    ``attend`` is the attention function: during a prefill (``prefill`` set) it attends within the
    prompts and copies their keys/values into their rows; otherwise (a decode step, one token per
    row) it writes each row's key/value at ``positions[row]`` and attends over the row's cache with
    ``kernel``: the whole row, masked past the position (SDPA), or only the keys up to the position
    (``used``, which ``begin_step`` sets once a step for every layer: one key for a finished row).
    """

    def __init__(self, slots: int, length: int, positions: torch.Tensor, done: torch.Tensor, kernel: str):
        self.slots, self.length, self.kernel = slots, length, kernel
        self.positions, self.done = positions, done  # [slots] each row's position, whether it finished (the decoder's)
        self.rows = torch.arange(slots, device=positions.device)
        self.row_starts = torch.arange(slots + 1, dtype=torch.int32, device=positions.device)  # flash's query offsets
        self.key_starts = self.row_starts * length  # flash's key offsets: row b's keys start at b x length
        self.used = torch.ones(slots, dtype=torch.int32, device=positions.device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.prefill: Prefill | None = None

    @property
    def packed(self) -> bool:
        return self.kernel != "masked"

    def begin_step(self, n: int) -> None:
        """Keys each of rows [:n] attends to in this step, shared by the layers: up to its position, one if finished."""
        self.used[:n] = torch.where(self.done[:n], 0, self.positions[:n]) + 1

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache of layer ``index``, zeroed at first (masked positions must be finite: 0 x NaN is NaN)."""
        if index not in self.keys:
            kv_heads, head_dim = like.shape[1], like.shape[3]
            shape = (self.slots, self.length, kv_heads, head_dim) if self.packed else (self.slots, kv_heads, self.length, head_dim)
            self.keys[index] = torch.zeros(shape, dtype=like.dtype, device=like.device)
            self.values[index] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self.keys[index], self.values[index]

    def attend(self, module, query, key, value, attention_mask, **options):
        """query [n, heads, q, D], key/value [n, kv_heads, q, D] (after RoPE) -> ([n, q, heads, D], None).

        transformers' attention function: ``options`` are the layer's keywords (``scaling``, ``dropout``:
        none at inference, and what ``check`` refuses)."""
        scaling = options.pop("scaling", None)
        self.check(options)
        cache = self.layer(module.layer_idx, key)
        if self.prefill is not None:
            return self.attend_prefill(query, key, value, attention_mask, scaling, cache), None
        keys, values = cache
        n, kv_heads, _, head_dim = key.shape
        keys, values, rows, positions = keys[:n], values[:n], self.rows[:n], self.positions[:n]
        scale = scaling if scaling is not None else head_dim ** -0.5
        if self.packed:
            keys[rows, positions] = key[:, :, 0]  # [n, kv_heads, D] at each row's position
            values[rows, positions] = value[:, :, 0]
            if self.kernel == "split":
                out = split_attention(query[:, :, 0], keys, values, self.used[:n], scale)
            else:
                starts = (self.row_starts[: n + 1], self.key_starts[: n + 1])
                out = varlen_attention(query[:, :, 0], keys, values, self.used[:n], scale, starts)
            return out[:, None], None  # [n, 1, heads, D]
        keys[rows, :, positions] = key[:, :, 0]
        values[rows, :, positions] = value[:, :, 0]
        return whole_row_attention(query[:, :, 0], keys, values, attention_mask, scale)[:, None], None  # [n, 1, heads, D]

    def check(self, options: dict) -> None:
        """Refuse what this plain causal attention would silently get wrong (Gemma's softcap, gpt-oss's sinks,
        a sliding window shorter than the cache)."""
        window = options.get("sliding_window")
        if options.get("softcap") or options.get("s_aux") is not None or (window and window < self.length):
            raise SlotsCannotAttend("the verifier's attention needs softcapping, sinks or a sliding window shorter than "
                                    "the answers, which slot decoding lacks")

    def attend_prefill(self, query, key, value, mask, scaling, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The prompts attend within themselves; their keys and values go to their rows of ``cache`` (keys, values)."""
        keys, values = cache
        n, kv_heads, width, head_dim = key.shape
        repeat = query.shape[1] // kv_heads  # query heads per kv head (kv head i serves heads i*repeat...)
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1),
                                             attn_mask=mask, scale=scaling)
        index = self.prefill.shift[:, None, :, None].expand(n, kv_heads, width, head_dim)
        rolled_keys, rolled_values = key.gather(2, index), value.gather(2, index)  # position j of row b = column shift[b, j]
        if self.packed:
            keys[self.prefill.slots, :width] = rolled_keys.transpose(1, 2)  # [n, T, kv_heads, D]
            values[self.prefill.slots, :width] = rolled_values.transpose(1, 2)
        else:
            keys[self.prefill.slots, :, :width] = rolled_keys
            values[self.prefill.slots, :, :width] = rolled_values
        return out.transpose(1, 2)  # [n, T, heads, D]


@contextmanager
def slot_attention(model, cache: SlotCache) -> Iterator[None]:
    """The verifier attends through ``cache`` inside the block (and as it was after)."""
    AttentionInterface.register(ATTENTION, cache.attend)
    before = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = before
        AttentionInterface.register(ATTENTION, detached)  # lets go of the cache


def detached(module, *args, **kwargs):
    raise RuntimeError(f"{ATTENTION} attention called outside slot decoding")


def prefill_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[n, T] left-padding mask -> [n, 1, T, T] bool: causal over real tokens; a pad attends to itself
    (a row with nothing to attend to would give NaN, and NaN times a zero weight stays NaN)."""
    width = attention_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    itself = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return (causal[None] & (attention_mask.bool()[:, None, :] | itself[None]))[:, None]


Finished = Callable[[Request, list[int]], None]


class SlotDecoder:
    """Answers to one ``Group``, drawn by ``sampling``: ``decode(requests, finished)`` calls ``finished(request, tokens)``
    per request (tokens: up to max_new_tokens, the stop token included)."""

    def __init__(self, model, group: Group, ending: Ending, kernel: str, sampling: Sampling = GREEDY):
        device = model.device
        self.model, self.slots, self.max_new_tokens, self.pad_id = model, group.slots, ending.max_new_tokens, ending.pad_id
        self.sampling = sampling
        self.tokens = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] the token each row feeds next
        self.positions = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] that token's position
        self.counts = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] tokens generated
        self.done = torch.ones(group.slots, dtype=torch.bool, device=device)  # [slots] finished or empty
        self.out = torch.zeros(group.slots, self.max_new_tokens, dtype=torch.long, device=device)  # [slots, N] generated
        self.columns = torch.arange(group.length, device=device)
        self.seeds = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] each row's request's seed
        self.eos = torch.tensor(sorted(ending.eos_ids), device=device)
        self.cache = SlotCache(group.slots, group.length, self.positions, self.done, kernel)
        self.unmasked = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # the packed kernels read ``used``
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # slot count -> the captured step
        self.replays = 0
        self.row_steps = 0  # rows x steps run, live or not: generated tokens / row_steps is the rows' use
        self.generated = 0

    def step(self, n: int) -> None:
        """One decode step of rows [:n]: every live row feeds its token and appends the next one it draws."""
        positions = self.positions[:n]
        if self.cache.packed:
            self.cache.begin_step(n)
            mask = self.unmasked
        else:
            mask = (self.columns[None, :] <= positions[:, None])[:, None, None, :]  # [n, 1, 1, length]: the row so far
        logits = self.model(input_ids=self.tokens[:n, None], position_ids=positions[:, None], attention_mask=mask,
                            use_cache=False, logits_to_keep=1).logits  # [n, 1, V]
        self.advance(n, self.sampling(logits[:, -1], self.seeds[:n], self.counts[:n]))

    def advance(self, n: int, picked: torch.Tensor) -> None:
        """Append ``picked`` [n] to the live rows; a row is done at an EOS token or max_new_tokens."""
        tokens, positions, counts, done, out = (t[:n] for t in (self.tokens, self.positions, self.counts, self.done, self.out))
        live = ~done
        column = counts.clamp(max=self.max_new_tokens - 1)
        rows = self.cache.rows[:n]
        out[rows, column] = torch.where(live, picked, out[rows, column])
        counts += live
        stop = (picked[:, None] == self.eos[None, :]).any(-1) | (counts >= self.max_new_tokens)
        done |= live & stop
        tokens.copy_(torch.where(live, picked, tokens))
        positions += live  # a finished row stays at its last position (rewriting it is harmless)

    def run_step(self, n: int) -> None:
        self.row_steps += n
        graph = self.graphs.get(n)
        if graph is None:
            self.step(n)
        else:
            graph.replay()
            self.replays += 1

    def capture(self) -> None:
        """CUDA graphs of the step over slots, slots/2, ... down to MIN_SLOTS; all rows are empty
        (done) now, so the warm-up steps change nothing but the empty rows' caches."""
        self.step(self.slots)  # allocates the cache on the current stream
        pool = torch.cuda.graph_pool_handle()  # graph scratch is shared: they never run at once
        n = self.slots
        while n >= MIN_SLOTS or n == self.slots:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
                self.step(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step(n)
            self.graphs[n] = graph
            n //= 2

    def fill(self, slots: list[int], requests: list[Request]) -> None:
        """Prefill ``requests`` into the rows ``slots``: their first token from the prompt's logits."""
        input_ids, attention_mask = left_pad([r.prompt_ids for r in requests], self.pad_id)  # [n, T]
        device = self.tokens.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        lengths = attention_mask.sum(1)  # [n]
        width = input_ids.shape[1]
        shift = ((width - lengths)[:, None] + torch.arange(width, device=device)[None]).clamp(max=width - 1)  # [n, T]
        rows = torch.tensor(slots, device=device)
        self.cache.prefill = Prefill(rows, shift)
        try:
            logits = self.model(input_ids=input_ids, position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
                                attention_mask=prefill_mask(attention_mask), use_cache=False, logits_to_keep=1).logits
        finally:
            self.cache.prefill = None
        self.seeds[rows] = torch.tensor([r.seed for r in requests], device=device)
        first = self.sampling(logits[:, -1], self.seeds[rows], torch.zeros_like(rows))  # [n]
        self.tokens[rows], self.positions[rows], self.counts[rows], self.out[rows, 0] = first, lengths, 1, first
        self.done[rows] = (first[:, None] == self.eos[None, :]).any(-1) | (self.max_new_tokens <= 1)

    def fill_chunks(self, slots: list[int], requests: list[Request]) -> None:
        """``fill`` in chunks of at most PREFILL_TOKENS padded tokens (requests sorted by length)."""
        start = 0
        while start < len(requests):
            end = start + 1
            while end < len(requests) and (end + 1 - start) * len(requests[end].prompt_ids) <= PREFILL_TOKENS:
                end += 1
            self.fill(slots[start:end], requests[start:end])
            start = end

    def harvest(self, owners: list[Request | None], n: int) -> list[tuple[Request, list[int]]]:
        """The answers of the rows that finished since the last look (the host's sync point); their rows are free."""
        rows = [row for row in self.done[:n].nonzero().flatten().tolist() if owners[row] is not None]
        if not rows:
            return []
        index = torch.tensor(rows, device=self.out.device)
        counts, tokens = self.counts[index].tolist(), self.out[index].tolist()
        answers = []
        for row, count, row_tokens in zip(rows, counts, tokens):
            answers.append((owners[row], row_tokens[:count]))
            self.generated += count
            owners[row] = None
        return answers

    def shrink(self, owners: list[Request | None], n: int) -> int:
        """With no prompt left: move the live rows to the front and return the smallest graph's slot
        count that holds them (n when none is smaller)."""
        live = [row for row in range(n) if owners[row] is not None]
        smaller = [size for size in self.graphs if len(live) <= size < n]
        if not smaller:
            return n
        size = min(smaller)
        index = torch.tensor(live, device=self.out.device)
        for tensor in (self.tokens, self.positions, self.counts, self.done, self.out, self.seeds,
                       *self.cache.keys.values(), *self.cache.values.values()):
            tensor[: len(live)] = tensor[index]
        self.done[len(live):] = True
        owners[:] = [owners[row] for row in live] + [None] * (len(owners) - len(live))
        return size

    def decode(self, requests: Sequence[Request], finished: Finished) -> None:
        pending = deque(requests)
        owners: list[Request | None] = [None] * self.slots
        harvested: list[tuple[Request, list[int]]] = []  # finished, not handed over yet
        n = self.slots
        with slot_attention(self.model, self.cache):
            if self.tokens.is_cuda:
                self.capture()
            while pending or any(owner is not None for owner in owners):
                free = [row for row in range(n) if owners[row] is None]
                if pending and (len(free) >= max(1, n // REFILL_SHARE) or len(free) == n):
                    taken = [pending.popleft() for _ in range(min(len(free), len(pending)))]
                    self.fill_chunks(free[: len(taken)], taken)
                    for row, request in zip(free, taken):
                        owners[row] = request
                if not pending:
                    n = self.shrink(owners, n)
                for _ in range(SYNC_STEPS):
                    self.run_step(n)
                for request, tokens in harvested:  # the host hands answers over (a journal's fsyncs) while the GPU steps
                    finished(request, tokens)
                harvested = self.harvest(owners, n)
            for request, tokens in harvested:
                finished(request, tokens)


@dataclass(frozen=True)
class Ending:
    """How every row of slot decoding ends and pads."""

    max_new_tokens: int  # a row ends after this many tokens ...
    eos_ids: Sequence[int]  # ... or at one of these
    pad_id: int  # the left padding of a prefill's prompts


def decode_groups(model, groups: Sequence[Group], ending: Ending, finished: Finished, kernel: str | None = None,
                  sampling: Sampling = GREEDY) -> int:
    """Decode every group (one cache at a time) with the decode attention ``kernel`` (default: the fastest
    that runs here), drawing by ``sampling``; returns the graph replays (0 without CUDA)."""
    replays = 0
    kernel = kernel or fastest_kernel(model)
    for group in groups:
        start = time.perf_counter()
        decoder = SlotDecoder(model, group, ending, kernel, sampling)
        decoder.decode(group.requests, finished)
        replays += decoder.replays
        log.info("slots: %d requests over %d rows x %d positions in %.1f s (%s attention): %d tokens, %d graph replays, "
                 "rows %.0f%% used", len(group.requests), group.slots, group.length, time.perf_counter() - start, kernel,
                 decoder.generated, decoder.replays, 100 * decoder.generated / max(decoder.row_steps, 1))
    return replays
