"""Greedy decoding over a slot KV cache, each decode step replayed as a CUDA graph: the ``local`` backend on CUDA.

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
- a decode step's attention (``KERNELS``, the first that runs here by default) reads each live row's
  used keys only: ``split`` (split_attention.py: Triton, the keys split across programs) or ``flash``
  (flash attention's varlen kernel) over a packed cache [slots, length, kv_heads, head_dim]; a finished
  row reads one key. ``masked`` (SDPA over whole rows, masked past each row's position) runs anywhere:
  the CPU, fp32, GPUs older than Ampere.

Requests are grouped by prompt width (``group_requests``): a group's cache is as long as its widest
prompt + max_new_tokens and has as many rows as ``batch_size`` and ``batch_tokens`` allow (the local
backend sizes the latter from the GPU memory free: ``cache_bytes_per_position``).

Greedy only (sampling keeps the eager path); a row ends at an EOS token or max_new_tokens, and the
backend cuts stop strings afterwards as it does for the eager path. Without CUDA (tests) the same
steps run eagerly.
"""

from __future__ import annotations

import functools
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
from eagle3.backends.padding import left_pad, padded_width
from eagle3.lm.spec import attention_shape

log = logging.getLogger(__name__)

ATTENTION = "eagle3_slots"  # our attention function's name in transformers' AttentionInterface
SYNC_STEPS = 16  # decode steps between two looks at which rows finished
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward
MIN_WIDTH = 256  # narrowest prompt-width bucket: groups by width 256, 512, 1024, ...
WIDTH_MULTIPLE = 64  # a group's cache length: its widest prompt rounded up to this, + max_new_tokens
MIN_SLOTS = 16  # smallest graph the drain moves down to
REFILL_SHARE = 8  # refill when 1/REFILL_SHARE of the rows are free (or none is decoding)
KERNELS = ("split", "flash", "masked")  # decode attention, fastest first (docs/benchmarks.md measures them)


@dataclass(frozen=True)
class Group:
    """Requests decoded over one cache of ``slots`` rows x ``length`` positions."""

    requests: list[Request]  # sorted by prompt length
    slots: int
    length: int  # widest prompt (rounded up to WIDTH_MULTIPLE) + max_new_tokens


def width_bucket(length: int) -> int:
    """The power of two (at least MIN_WIDTH) a prompt of ``length`` tokens is grouped under: 90 -> 256, 300 -> 512."""
    return max(MIN_WIDTH, 1 << (length - 1).bit_length())


def group_requests(requests: Sequence[Request], max_new_tokens: int, batch_size: int, batch_tokens: int | None) -> list[Group]:
    """Requests sorted by (prompt length, id), cut into groups by ``width_bucket``; a group smaller than
    its slot count joins the next one (each group ends with a drain: fewer groups, fewer drains).

    Slots: ``batch_size`` rows, fewer when rows x length would exceed ``batch_tokens``, never more
    than the group's requests. Example: lengths [10, 20, 300], max_new_tokens 100, batch_size 2 ->
    one group of the 2 short prompts (256 bucket, length 64 + 100) and one of [300] (length 320 + 100).
    """
    ordered = sorted(requests, key=lambda r: (len(r.prompt_ids), r.id))
    buckets: dict[int, list[Request]] = {}
    for request in ordered:
        buckets.setdefault(width_bucket(len(request.prompt_ids)), []).append(request)
    groups, carried = [], []
    for index, bucket in enumerate(buckets.values()):
        carried += bucket
        length = padded_width(len(carried[-1].prompt_ids), WIDTH_MULTIPLE) + max_new_tokens
        slots = min(batch_size, max(1, batch_tokens // length) if batch_tokens else batch_size)
        if len(carried) >= slots or index == len(buckets) - 1:
            groups.append(Group(carried, min(slots, len(carried)), length))
            carried = []
    return groups


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

    def attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """query [n, heads, q, D], key/value [n, kv_heads, q, D] (after RoPE) -> ([n, q, heads, D], None)."""
        self.check(kwargs)
        keys, values = self.layer(module.layer_idx, key)
        if self.prefill is not None:
            return self.attend_prefill(query, key, value, attention_mask, scaling, keys, values), None
        n, kv_heads, _, head_dim = key.shape
        keys, values, rows, positions = keys[:n], values[:n], self.rows[:n], self.positions[:n]
        scale = scaling if scaling is not None else head_dim ** -0.5
        if self.packed:
            keys[rows, positions] = key[:, :, 0]  # [n, kv_heads, D] at each row's position
            values[rows, positions] = value[:, :, 0]
            if self.kernel == "split":
                out = split_attention(query[:, :, 0], keys, values, self.used[:n], scale)
            else:
                out = varlen_attention(query[:, :, 0], keys, values, self.used[:n], scale, self.row_starts[: n + 1],
                                       self.key_starts[: n + 1])
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

    def attend_prefill(self, query, key, value, mask, scaling, keys, values) -> torch.Tensor:
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
                     row_starts: torch.Tensor, key_starts: torch.Tensor) -> torch.Tensor:
    """``masked_attention`` by flash attention's varlen kernel on CUDA: row b's keys start at
    ``key_starts[b]`` (b x length) of the flattened cache and it reads ``used[b]`` of them (int32, as are
    ``row_starts``, 0..n: one query a row)."""
    if not query.is_cuda:
        return masked_attention(query, keys, values, used, scale)
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
            varlen_attention(query, keys, keys, used, 1.0, starts, starts * 16)
        return True
    except Exception as reason:  # noqa: BLE001 (an unsupported GPU, dtype or shape, or no Triton: the next kernel)
        log.info("slots: decode kernel %s does not run here (%s: %s)", kernel, type(reason).__name__, reason)
        return False


def fastest_kernel(model) -> str:
    """The first of KERNELS that runs for this verifier on its device."""
    shape = attention_shape(model.config.get_text_config())
    return next(k for k in KERNELS if kernel_runs(k, model.device, model.dtype, *shape))


def cache_bytes_per_position(model) -> int:
    """Bytes of the slot cache a row position takes: keys and values of every layer (SmolLM2-135M in bf16:
    2 x 30 layers x 3 kv heads x 64 x 2 bytes = 23,040; Llama-3.1-8B: 131,072)."""
    config = model.config.get_text_config()
    _, kv_heads, head_dim = attention_shape(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


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
    """Greedy answers to one ``Group``: ``decode(requests, finished)`` calls ``finished(request, tokens)``
    per request (tokens: up to max_new_tokens, the stop token included)."""

    def __init__(self, model, group: Group, max_new_tokens: int, eos_ids: Sequence[int], pad_id: int, kernel: str):
        device = model.device
        self.model, self.slots, self.max_new_tokens, self.pad_id = model, group.slots, max_new_tokens, pad_id
        self.tokens = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] the token each row feeds next
        self.positions = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] that token's position
        self.counts = torch.zeros(group.slots, dtype=torch.long, device=device)  # [slots] tokens generated
        self.done = torch.ones(group.slots, dtype=torch.bool, device=device)  # [slots] finished or empty
        self.out = torch.zeros(group.slots, max_new_tokens, dtype=torch.long, device=device)  # [slots, N] generated
        self.columns = torch.arange(group.length, device=device)
        self.eos = torch.tensor(sorted(eos_ids), device=device)
        self.cache = SlotCache(group.slots, group.length, self.positions, self.done, kernel)
        self.unmasked = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)  # the packed kernels read ``used``
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # slot count -> the captured step
        self.replays = 0
        self.row_steps = 0  # rows x steps run, live or not: generated tokens / row_steps is the rows' use
        self.generated = 0

    def step(self, n: int) -> None:
        """One decode step of rows [:n]: every live row feeds its token and appends the greedy next one."""
        positions = self.positions[:n]
        if self.cache.packed:
            self.cache.begin_step(n)
            mask = self.unmasked
        else:
            mask = (self.columns[None, :] <= positions[:, None])[:, None, None, :]  # [n, 1, 1, length]: the row so far
        logits = self.model(input_ids=self.tokens[:n, None], position_ids=positions[:, None], attention_mask=mask,
                            use_cache=False, logits_to_keep=1).logits  # [n, 1, V]
        self.advance(n, logits[:, -1].argmax(-1))

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
        first = logits[:, -1].argmax(-1)  # [n]
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
        for tensor in (self.tokens, self.positions, self.counts, self.done, self.out,
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


def decode_groups(model, groups: Sequence[Group], max_new_tokens: int, eos_ids: Sequence[int], pad_id: int,
                  finished: Finished, kernel: str | None = None) -> int:
    """Decode every group (one cache at a time) with the decode attention ``kernel`` (default: the fastest
    that runs here); returns the graph replays (0 without CUDA)."""
    replays = 0
    kernel = kernel or fastest_kernel(model)
    for group in groups:
        start = time.perf_counter()
        decoder = SlotDecoder(model, group, max_new_tokens, eos_ids, pad_id, kernel)
        decoder.decode(group.requests, finished)
        replays += decoder.replays
        log.info("slots: %d requests over %d rows x %d positions in %.1f s (%s attention): %d tokens, %d graph replays, "
                 "rows %.0f%% used", len(group.requests), group.slots, group.length, time.perf_counter() - start, kernel,
                 decoder.generated, decoder.replays, 100 * decoder.generated / max(decoder.row_steps, 1))
    return replays
