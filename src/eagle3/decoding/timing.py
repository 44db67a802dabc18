"""Tokens/s and speedup of every decoding method, per batch size, over repeats: median and spread.

    runs = decode_all(session, prompts, batch_size=4, repeats=3)   # {method: Run}; session: eagle3.decoding.session
    timings(runs)["chain"]   # {"tokens_per_s", "tokens_per_s_spread", "speedup", "speedup_spread"}

Why: a speedup is what a user of an engine sees, and it varies with the load and the batch size.
The methods are timed alternately per batch (fair under a varying load), each ``repeats`` times,
after an untimed warm-up (``warm_up``); a speedup pairs each repeat with plain decoding's same one,
and repeats that disagree by more than UNSTABLE_SPREAD are flagged (``disagreeing``). On a GPU
the steps are CUDA graphs (``decode_graphs``, ``eagle3.decoding.graphed``), whose replay times
also give each method's price in verifier forwards (``step_costs``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from eagle3.decoding.acceptance import acceptance_stats
from eagle3.decoding.graphed import DecodeGraphs
from eagle3.decoding.session import Session
from eagle3.decoding.settings import Settings
from eagle3.decoding.speculative import prefill, speculative_decode
from eagle3.decoding.tree import EagleProposer
from eagle3.decoding.config import TreeShape

WARMUP_TOKENS = 2  # the untimed decode of every method before the first set: its prefill and one round (``warm_up``)
WARMUP_PROMPT_TOKENS = 16  # of each warm-up prompt
UNSTABLE_SPREAD = 0.10  # repeats whose tokens/s or speedup differ by more than this (of the median) are flagged


@dataclass
class Run:
    """One decoding method over one eval set."""

    outputs: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    accepted: list[list[int]] = field(default_factory=list)  # per prompt, drafts accepted per verifier forward
    seconds: list[float] = field(default_factory=list)  # decoding time per repeat, summed over batches

    @property
    def pooled(self) -> list[int]:
        """Drafts accepted per verifier forward, pooled over the prompts."""
        return [j for answer in self.accepted for j in answer]

    @property
    def rates(self) -> list[float]:
        """Tokens/s per repeat."""
        tokens = sum(map(len, self.outputs))
        return [tokens / s for s in self.seconds]


def median_spread(values: Sequence[float]) -> tuple[float, float | None]:
    """(median, (max - min) / median) of repeated measurements; the spread is None for one.

    Example: [10, 12, 11] -> (11, 0.1818...)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return median, (ordered[-1] - ordered[0]) / median if len(ordered) > 1 else None


def batched(columns: Sequence[Sequence], batch_size: int, rows: int | None) -> Iterator[tuple[int, list[list]]]:
    """(count, each column's batch) for every ``batch_size`` items of the columns (parallel sequences), each batch
    filled up to ``rows`` with copies of its last item (None: not filled), as an engine pads a batch to a
    captured size. Example: [[a, b, c]], 2, rows 2 -> (2, [[a, b]]), (1, [[c, c]])."""
    for start in range(0, len(columns[0]), batch_size):
        parts = [list(column[start : start + batch_size]) for column in columns]
        count = len(parts[0])
        yield count, [part + part[-1:] * ((rows or count) - count) for part in parts]


def decode_all(session: Session, prompts: Sequence[torch.Tensor], batch_size: int,
               methods: Mapping[str, TreeShape | None] | None = None, repeats: int = 1, max_new_tokens: int | None = None) -> dict[str, Run]:
    """Every method (default ``settings.methods()``) of the session on every batch of ``batch_size`` prompts, alternating
    methods per batch (fair under a varying load), the batch's methods ``repeats`` times in turn.

    The prompts of a batch are prefilled once, untimed, and every method decodes from a copy: the
    prefill is the same work for all of them, so times and speedups are of decoding alone. Outputs
    and acceptance are of the first repeat (greedy decoding repeats them exactly).
    With the session's graphs: decode in static caches with captured steps (``eagle3.decoding.graphed``),
    every method alike; a last, smaller batch is filled up with copies of its last prompt (``graph_rows``),
    as an engine pads a batch to a captured size, and only its own rows are counted. With its stops:
    answers also end at ``model.stop``'s strings.
    """
    settings, target, graphs = session.settings, session.target, session.graphs
    methods = methods or settings.methods()
    runs = {name: Run(seconds=[0.0] * repeats) for name in methods}
    rows = graph_rows(len(prompts), batch_size) if graphs is not None else None
    for count, (batch,) in tqdm(batched([prompts], batch_size, rows), desc="/".join(methods), unit="batch",
                                total=-(-len(prompts) // batch_size), leave=False):
        prefilled = prefill(target.verifier, batch, target.layer_ids)
        for repeat in range(repeats):
            for name, shape in methods.items():
                proposer = EagleProposer(session.drafter, shape, graphs) if shape else None
                start = time.perf_counter()
                decoded = speculative_decode(target, proposer, batch, max_new_tokens or settings.max_new_tokens, prefilled)
                if str(settings.device).startswith("cuda"):
                    torch.cuda.synchronize()
                runs[name].seconds[repeat] += time.perf_counter() - start
                if repeat == 0:
                    for d in decoded[:count]:
                        runs[name].outputs.append(d.tokens)
                        runs[name].accepted.append(d.accepted)
    return runs


def timings(runs: Mapping[str, Run]) -> dict[str, dict]:
    """Per method, tokens/s and (against the run named ``plain``) speedup over the repeats: median and spread.

    A repeat's speedup pairs it with plain decoding's same repeat (timed in turn, batch by batch),
    so a load that changes between repeats changes both. Example, plain 10 and 12 s, chain 5 and
    8 s for the same tokens: speedups 2.0 and 1.5 -> speedup 1.75, speedup_spread 0.286.
    """
    plain = runs["plain"].rates
    report = {}
    for name, run in runs.items():
        rate, rate_spread = median_spread(run.rates)
        report[name] = {"tokens_per_s": rate, "tokens_per_s_spread": rate_spread}
        if name != "plain":
            speedup, spread = median_spread([mine / theirs for mine, theirs in zip(run.rates, plain)])
            report[name].update(speedup=speedup, speedup_spread=spread)
    return report


def disagreeing(timing: Mapping[str, dict]) -> list[str]:
    """The measurements of ``timings`` whose repeats differ by more than UNSTABLE_SPREAD, e.g. ["tree/speedup"]."""
    return [f"{name}/{key.removesuffix('_spread')}" for name, row in timing.items() for key, value in row.items()
            if key.endswith("_spread") and value is not None and value > UNSTABLE_SPREAD]


def timed_prompts(prompts: Sequence[torch.Tensor], settings: Settings, batch_size: int) -> Sequence[torch.Tensor]:
    """The prompts batch size ``batch_size`` is timed on: the first ``timed_prompts``, at least one batch of
    that size, or all of them (None). Example: 500 prompts, timed_prompts 2: batch 1 -> 2, batch 64 -> 64."""
    if settings.timed_prompts is None:
        return prompts
    return prompts[: max(settings.timed_prompts, batch_size)]


def chain_sweep(session: Session, prompts: Sequence[torch.Tensor]) -> dict:
    """Chains of every K in ``chain_sweep`` timed against plain decoding at the first batch size, on ``prompts``
    (its timed ones) for ``timed_tokens`` each: {"timing": ``timings``, "tau": {name: τ}, "costs": {name: ...},
    "best": the K of the highest median speedup}."""
    settings = session.settings
    size = settings.batch_sizes[0]
    methods = settings.chain_methods()
    runs = decode_all(session, prompts, size, methods, settings.repeats, settings.timed_tokens)
    timing = timings(runs)
    chains = {name: shape for name, shape in methods.items() if shape}
    best = max(chains, key=lambda name: timing[name]["speedup"])
    return {"timing": timing, "tau": {name: acceptance_stats(runs[name].pooled, shape.num_steps)["tau"] for name, shape in chains.items()},
            "costs": {name: step_costs(session, prompts, size, shape) for name, shape in chains.items()},
            "best": chains[best].num_steps}


def step_costs(session: Session, prompts: Sequence[torch.Tensor], batch_size: int, shape: TreeShape) -> dict:
    """With the session's graphs: a proposal's and a verify forward's time over a 1-token verifier forward, at the
    batches' rows, each graph replayed alone: {"draft_cost", "draft_step_cost" (per drafter step),
    "verify_cost"}; eager: {}.

    Why beside τ: speedup ≈ τ / (verify_cost + draft_cost) against plain decoding at the same batch,
    so the two say whether a low speedup is the drafter's acceptance or its price.
    """
    graphs = session.graphs
    if graphs is None:
        return {}
    rows = graph_rows(len(prompts), batch_size)
    forward = graphs.replay_seconds(graphs.verifier_key(rows, 1))
    draft = graphs.replay_seconds(graphs.draft_key(session.drafter, shape, rows))
    verify = graphs.replay_seconds(graphs.verifier_key(rows, shape.num_draft_tokens))
    if None in (forward, draft, verify):  # every answer ended before a second round: no draft graph was needed
        return {}
    return {"draft_cost": draft / forward, "draft_step_cost": draft / forward / shape.num_steps, "verify_cost": verify / forward}


def warm_up(session: Session, prompts: Sequence[torch.Tensor], row_counts: Sequence[int] = (),
            methods: Mapping[str, TreeShape | None] | None = None) -> None:
    """A short untimed decode of every method on the first batch, so one-off setup costs (allocator,
    kernels, first calls) are timed in no method.

    Its prompts are cut to their last WARMUP_PROMPT_TOKENS: a whole prompt's prefill costs more
    than the rest of the warm-up (about 1.5 s of the demo's) and sets up nothing a short one does not.
    ``methods``: those to warm up (default ``settings.methods()``). With the session's graphs, every batch row
    count in ``row_counts`` is warmed up with them, each for two rounds whatever is accepted (the second captures
    the drafter's graph; no stop string ends a warm-up answer): graphs are per row count and shape.
    """
    settings, session = session.settings, session.without_stops()
    if session.graphs is None:
        first = [p[-WARMUP_PROMPT_TOKENS:] for p in prompts[: settings.batch_sizes[0]]]
        decode_all(session, first, settings.batch_sizes[0], methods, max_new_tokens=WARMUP_TOKENS)
        return
    methods = methods or settings.methods()
    tokens = min(WARMUP_TOKENS + max(shape.num_steps + 1 for shape in methods.values() if shape), settings.max_new_tokens)
    for rows in row_counts:
        first = [prompts[i % len(prompts)][-WARMUP_PROMPT_TOKENS:] for i in range(rows)]
        decode_all(session, first, rows, methods, max_new_tokens=tokens)


def decode_graphs(settings: Settings, longest_prompt: int) -> DecodeGraphs | None:
    """CUDA graphs for decoding on a GPU with a whole verifier per process (as engines serve), for prompts
    of at most ``longest_prompt`` tokens; None: eager.

    Why not on the CPU: a CPU has no launch cost to save, and its measurement stays as it was.
    """
    if not (settings.cuda_graphs and settings.device.startswith("cuda")) or settings.placement.sharded:
        return None
    return DecodeGraphs(longest_prompt, settings.max_new_tokens, capture=True)


def graph_rows(count: int, batch_size: int) -> int:
    """The rows of every batch of ``count`` prompts decoded ``batch_size`` at a time with graphs (captured per row count)."""
    return min(count, batch_size)
