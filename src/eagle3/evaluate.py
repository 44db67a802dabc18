"""Stage ``evaluate``: the drafter's measured acceptance length τ and speedup, by real speculative decoding.

    python -m eagle3.evaluate models/verifier models/drafter data/prompts dvclive/evaluate
    # reads params.yaml: evaluate, layout.device/dtype/threads/verifier, model.stop, model.trust_remote_code

Why: training accuracy is a proxy; a drafter is judged by τ (tokens per verifier forward) and the
speedup it gives, with the drafting SGLang and vLLM serve: a chain of K drafts, and SGLang's draft
tree. The drafter is loaded from its export (``load_drafter``), never from training objects, so a
broken export shows up here as τ ≈ the baselines'.

For each eval set (``data/prompts/eval/<set>.jsonl``, rendered with the chat template and the
generation prompt), the prompts are decoded a batch at a time (``eagle3.drafter.speculative``) by
plain greedy decoding, chain drafting and tree drafting, alternately per batch, ``evaluate.repeats``
times each, for every batch size of ``evaluate.batch_sizes``; τ and the outputs (which must be
identical) come from the first size. Speedup = tokens/s over plain greedy decoding at the same batch
size and repeat: median and spread over repeats (``timings``). On a GPU the steps are CUDA graphs
over static caches (``eagle3.drafter.graphed``), as engines serve; answers end at EOS,
``max_new_tokens`` or a ``model.stop`` string. Two baselines are replayed on the plain greedy output
(exact under greedy verification, and free): the set's most frequent output token K times (the best
context-free chain drafter), and prompt lookup (``ngram``, as vLLM and SGLang ship it). A drafter
near the baselines' τ is broken.

Output (dvclive, ``dvcyaml=False``), written by ``log_report`` alone: ``metrics.json`` with
``wall_seconds`` and per set ``tau``, ``lossless`` (fraction of prompts whose output equals plain
greedy), ``forwards`` (the chain's), ``tree/{tau, lossless, forwards}``, ``baseline/{tau, token}``,
``ngram/{tau, tau_matched_rounds, matched_rounds}``, ``tokens``, ``prompts``, ``seconds``; with graphs
``draft_cost``, ``draft_step_cost``, ``verify_cost`` (and the tree's) and, on the first set,
``chain_k/k<K>/...`` and ``chain_k/best``; with repeats > 1 the timings: ``speedup``,
``speedup_spread``, ``tokens_per_s(_spread)``, ``plain_tokens_per_s(_spread)`` (and the tree's) at
the first batch size, the same per size under ``batch/<B>/``, and ``unstable``. Plots
``plots/custom/acceptance/<set>.json`` (per draft position or tree depth k: the fraction of verifier
forwards that accepted k drafts or more, hence τ = 1 + Σ_k acceptance_k),
``plots/custom/tau/<set>.json`` (the distribution of τ over forwards), both with the series
``drafter`` (the chain), ``tree``, ``baseline`` and ``ngram``, and ``plots/custom/speedup/<set>.json``
(``drafter`` and ``tree`` per batch size), which dvc.yaml's top-level ``plots`` draws in one chart each.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import UserError, atomic_dir, read_json, read_jsonl, stage_main
from eagle3.config import stage_params
from eagle3.drafter.export import check_drafter, load_drafter
from eagle3.drafter.graphed import DecodeGraphs
from eagle3.drafter.speculative import (EagleProposer, StopStrings, TreeShape, most_frequent, ngram, prefill, replay,
                                        skinny_matmuls, speculative_decode)
from eagle3.verifiers.chat import prompt_ids
from eagle3.verifiers.loading import (Placement, close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier,
                                      shard_rank, text_config, tokenizer_fingerprint)
from eagle3.verifiers.spec import VerifierSpec, require_verifier

log = logging.getLogger(__name__)

PARAMS = ("evaluate", "layout.device", "layout.dtype", "layout.threads", "layout.verifier", "model.stop",
          "model.trust_remote_code")  # = dvc.yaml

WARMUP_TOKENS = 2  # the untimed decode of every method before the first set: its prefill and one round (``warm_up``)
WARMUP_PROMPT_TOKENS = 16  # of each warm-up prompt


@dataclass(frozen=True)
class Settings:
    """What ``evaluate`` reads from params: its section and the layout (hardware only)."""

    draft_tokens: int  # K: chain drafts per verifier forward
    tree: TreeShape | None  # SGLang's draft tree (num_steps, topk, num_draft_tokens); None: chain only
    batch_sizes: tuple[int, ...]  # prompts decoded together, one timing per size; τ and outputs at the first
    repeats: int  # timings per batch size (median and spread); one: no spread, so no speedup metric
    timed_prompts: int | None  # timings on the first this many prompts of a set (at least the largest batch); None: all
    chain_sweep: tuple[int, ...]  # chain K also timed, on the first set at the first batch size (the best K)
    cuda_graphs: bool  # on a GPU, static caches and captured steps (``eagle3.drafter.graphed``); False: eager
    max_new_tokens: int  # tokens generated per prompt (fewer at EOS)
    sets: tuple[str, ...]  # eval sets: data/prompts/eval/<set>.jsonl
    max_prompts: int | None  # at most this many prompts per set (file order); None: all
    baseline: bool  # also replay the most-frequent-token and n-gram baselines
    device: str
    dtype: str
    threads: int
    stop: tuple[str, ...]  # model.stop: strings ending an answer besides EOS (decoding stops there, as generation did)
    trust_remote_code: bool
    placement: Placement  # layout.verifier: tp > 1 decodes with one copy sharded over tp torchrun processes

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        cfg, layout, spec = params.evaluate, params.layout, VerifierSpec.from_params(params.model)
        tree = cfg.tree
        return cls(  # values validated by config.validate (stage_params), the tree's shape included
            int(cfg.draft_tokens), None if tree is None else TreeShape(int(tree.num_steps), int(tree.topk), int(tree.num_draft_tokens)),
            tuple(map(int, cfg.batch_sizes)), int(cfg.repeats), None if cfg.timed_prompts is None else int(cfg.timed_prompts),
            tuple(map(int, cfg.chain_sweep)), bool(cfg.cuda_graphs),
            int(cfg.max_new_tokens), tuple(cfg.sets),
            None if cfg.max_prompts is None else int(cfg.max_prompts), bool(cfg.baseline),
            str(layout.device), str(layout.dtype), int(layout.threads), spec.stop, spec.trust_remote_code,
            Placement.from_params(layout),
        )

    def methods(self) -> dict[str, TreeShape | None]:
        """Decoding methods: plain greedy (None), the chain, and the tree when configured."""
        return {"plain": None, "chain": TreeShape.chain(self.draft_tokens), **({"tree": self.tree} if self.tree else {})}

    def chain_methods(self) -> dict[str, TreeShape | None]:
        """Plain greedy and a chain per K of ``chain_sweep``: {"plain": None, "k2": chain(2), ...}."""
        return {"plain": None, **{f"k{k}": TreeShape.chain(k) for k in self.chain_sweep}}


UNSTABLE_SPREAD = 0.10  # repeats whose tokens/s or speedup differ by more than this (of the median) are flagged


@dataclass
class Run:
    """One decoding method over one eval set."""

    outputs: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verifier forward, pooled over prompts
    seconds: list[float] = field(default_factory=list)  # decoding time per repeat, summed over batches

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


# --- inputs ----------------------------------------------------------------------------------------


def load_eval_sets(prompts_dir: Path, sets: Sequence[str], max_prompts: int | None) -> dict[str, list[dict]]:
    """Prompt records of each set, at most ``max_prompts`` each (file order)."""
    loaded = {}
    for name in sets:
        path = prompts_dir / "eval" / f"{name}.jsonl"
        if not path.is_file():
            raise UserError(f"{path}: eval set {name!r} not found; list only sets of dataset.eval_sets in evaluate.sets")
        records = list(read_jsonl(path))[:max_prompts]
        if not records:
            raise UserError(f"{path}: no prompts; the prompts stage wrote an empty eval set")
        loaded[name] = records
    return loaded


def check_pair(verifier_dir: Path, drafter_dir: Path, prompts_dir: Path) -> None:
    """Refuse a drafter export with faults or trained for another verifier, and prompts of another verifier."""
    problems = check_drafter(drafter_dir, verifier_dir)
    if problems:
        raise UserError(f"{drafter_dir}: {problems[0]}" + (f" (and {len(problems) - 1} more; run eagle3 check-drafter)" if len(problems) > 1 else ""))
    tokenizer = tokenizer_fingerprint(verifier_dir)  # not the weights': another machine's import of them differs
    prompts = read_json(prompts_dir / "meta.json").get("tokenizer")
    require_verifier(f"{prompts_dir}/meta.json", "prompts counted with the tokenizer and chat template of", prompts,
                     tokenizer, "this verifier's are", "rerun prompts")


# --- measurement -----------------------------------------------------------------------------------


def batches(items: Sequence, size: int) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def decode_all(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int], batch_size: int,
               methods: Mapping[str, TreeShape | None] | None = None, repeats: int = 1, max_new_tokens: int | None = None,
               graphs: DecodeGraphs | None = None, stops: StopStrings | None = None) -> dict[str, Run]:
    """Every method (default ``settings.methods()``) on every batch of ``batch_size`` prompts, alternating
    methods per batch (fair under a varying load), the batch's methods ``repeats`` times in turn.

    The prompts of a batch are prefilled once, untimed, and every method decodes from a copy: the
    prefill is the same work for all of them, so times and speedups are of decoding alone. Outputs
    and acceptance are of the first repeat (greedy decoding repeats them exactly).
    ``graphs``: decode in static caches with captured steps (``eagle3.drafter.graphed``), every method
    alike; a last, smaller batch is filled up with copies of its last prompt (``graph_rows``), as an
    engine pads a batch to a captured size, and only its own rows are counted. ``stops``: answers
    also end at ``model.stop``'s strings.
    """
    methods = methods or settings.methods()
    runs = {name: Run(seconds=[0.0] * repeats) for name in methods}
    layer_ids = drafter.config.aux_layers
    for batch in tqdm(batches(prompts, batch_size), desc="/".join(methods), unit="batch", leave=False):
        rows = len(batch)
        if graphs is not None:
            batch = [*batch, *[batch[-1]] * (graph_rows(len(prompts), batch_size) - rows)]
        prefilled = prefill(verifier, batch, layer_ids)
        for repeat in range(repeats):
            for name, shape in methods.items():
                proposer = EagleProposer(drafter, shape, graphs) if shape else None
                start = time.perf_counter()
                decoded = speculative_decode(verifier, proposer, batch, layer_ids, max_new_tokens or settings.max_new_tokens,
                                             eos_ids, prefilled, graphs, stops)
                if str(settings.device).startswith("cuda"):
                    torch.cuda.synchronize()
                runs[name].seconds[repeat] += time.perf_counter() - start
                if repeat == 0:
                    for d in decoded[:rows]:
                        runs[name].outputs.append(d.tokens)
                        runs[name].accepted += d.accepted
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


def acceptance_stats(accepted: Sequence[int], k: int) -> dict:
    """τ and its breakdown from the drafts accepted per verifier forward (j in 0..K; τ = j + 1).

    acceptance[i] = fraction of forwards that accepted draft i+1 (and so all before it), so
    tau = 1 + sum(acceptance); conditional[i] = that fraction among forwards that reached draft i+1;
    tau_distribution[i] = fraction of forwards with τ = i + 1. Example, K=2, accepted [0, 2, 1, 2]:
    tau 2.25, acceptance [0.75, 0.5], conditional [0.75, 0.667], tau_distribution [0.25, 0.25, 0.5].
    """
    counts = torch.bincount(torch.tensor(list(accepted), dtype=torch.long), minlength=k + 1).double()  # [K+1]
    forwards = counts.sum().clamp(min=1)  # no forwards (every prompt ended at prefill): τ reads 1
    reached = counts.flip(0).cumsum(0).flip(0)  # [K+1]: forwards with j >= i
    return {
        "forwards": len(accepted),
        "tau": float(1 + (reached[1:].sum() / forwards)),
        "acceptance": (reached[1:] / forwards).tolist(),
        "conditional": (reached[1:] / reached[:-1].clamp(min=1)).tolist(),
        "tau_distribution": (counts / forwards).tolist(),
    }


def most_frequent_token(outputs: Sequence[list[int]]) -> int:
    """The most frequent generated token (ties: the lower id)."""
    counts = Counter(token for tokens in outputs for token in tokens)
    return min(counts, key=lambda token: (-counts[token], token))


def summarize(run: Run, plain: Run, k: int) -> dict:
    """τ and acceptance of a speculative run, and the share of its outputs equal to the plain greedy run's."""
    lossless = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / len(plain.outputs)
    if lossless < 1:
        log.warning("%.0f%% of outputs differ from plain greedy decoding (numerical ties, or a bug)", 100 * (1 - lossless))
    return {**acceptance_stats(run.accepted, k), "lossless": lossless}


def baselines(prompts: Sequence[torch.Tensor], outputs: Sequence[list[int]], k: int) -> dict:
    """The most-frequent-token and n-gram baselines, replayed on the plain greedy outputs.

    Both ``tau`` are per sequence, over every verifier forward (comparable with the drafter's τ).
    Prompt lookup proposes nothing where it finds no match, so it also has ``tau_matched_rounds``
    (τ over the forwards it drafted for) and ``matched_rounds`` (their share): e.g. 10 forwards,
    4 with a match accepting 2 each -> tau 1.8, tau_matched_rounds 3.0, matched_rounds 0.4.
    """
    token = most_frequent_token(outputs)
    report = {}
    for name, propose in (("baseline", most_frequent(token)), ("ngram", ngram)):
        accepted = [j for ids, out in zip(prompts, outputs) for j in replay(propose, ids.tolist(), out, k)]
        report[name] = acceptance_stats(accepted, k)
    report["baseline"]["token"] = token
    matched = [j for ids, out in zip(prompts, outputs) for j in replay(ngram, ids.tolist(), out, k, drafted_only=True)]
    report["ngram"]["tau_matched_rounds"] = acceptance_stats(matched, k)["tau"]
    report["ngram"]["matched_rounds"] = len(matched) / max(1, report["ngram"]["forwards"])
    return report


def evaluate_set(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
                 graphs: DecodeGraphs | None = None, sweep_chains: bool = False, stops: StopStrings | None = None) -> dict:
    """Plain vs chain vs tree decoding of ``prompts`` (and the baselines): {"plain", "chain", "tree"?, ...,
    "batch": {batch size: ``timings``}, "unstable": [...], "chain_k"?: ``chain_sweep``}.

    τ and outputs are decoded once, at the largest batch size (they do not depend on it; it is the
    fastest); every batch size is timed ``repeats`` times on the ``timed`` prompts. Where those are
    all the prompts, the largest size's timing is that same decode (the demo: one decode in all).
    """
    start = time.perf_counter()
    largest, timed = max(settings.batch_sizes), timed_prompts(prompts, settings)
    whole = len(timed) == len(prompts)
    runs = decode_all(verifier, drafter, prompts, settings, eos_ids, largest, repeats=settings.repeats if whole else 1,
                      graphs=graphs, stops=stops)
    plain = runs["plain"]
    report = {"plain": {"tokens": sum(map(len, plain.outputs)), "prompts": len(prompts), "timed_prompts": len(timed)}}
    for name, shape in settings.methods().items():
        if shape:
            report[name] = summarize(runs[name], plain, shape.num_steps)
    if settings.baseline:
        report.update(baselines(prompts, plain.outputs, settings.draft_tokens))
    report["batch"] = {}
    for size in settings.batch_sizes:
        report["batch"][size] = timings(runs if whole and size == largest else
                                        decode_all(verifier, drafter, timed, settings, eos_ids, size, repeats=settings.repeats,
                                                   graphs=graphs, stops=stops))
    for name, shape in settings.methods().items():
        if shape:
            report[name].update(step_costs(graphs, drafter, timed, settings.batch_sizes[0], shape))
    if sweep_chains and settings.chain_sweep:
        report["chain_k"] = chain_sweep(verifier, drafter, timed, settings, eos_ids, graphs, stops)
    report["unstable"] = [f"batch {size}: {what}" for size, timing in report["batch"].items() for what in disagreeing(timing)]
    report["unstable"] += [f"chain K sweep: {what}" for what in disagreeing(report.get("chain_k", {}).get("timing", {}))]
    if report["unstable"]:
        log.warning("repeated timings disagree by more than %d%% (%s): a varying load; these speedups do not repeat",
                    100 * UNSTABLE_SPREAD, ", ".join(report["unstable"]))
    report["plain"]["seconds"] = time.perf_counter() - start
    return report


def timed_prompts(prompts: Sequence[torch.Tensor], settings: Settings) -> Sequence[torch.Tensor]:
    """The prompts every batch size is timed on: the first ``timed_prompts`` (at least a batch of the
    largest size), or all of them (None). Example: 500 prompts, timed_prompts 64, sizes [1, 128] -> 128."""
    if settings.timed_prompts is None:
        return prompts
    return prompts[: max(settings.timed_prompts, *settings.batch_sizes)]


def chain_sweep(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
                graphs: DecodeGraphs | None, stops: StopStrings | None = None) -> dict:
    """Chains of every K in ``chain_sweep`` timed against plain decoding at the first batch size:
    {"timing": ``timings``, "tau": {name: τ}, "draft_cost": {name: ...}?, "best": the K of the highest median speedup}."""
    size = settings.batch_sizes[0]
    methods = settings.chain_methods()
    runs = decode_all(verifier, drafter, prompts, settings, eos_ids, size, methods, settings.repeats, graphs=graphs, stops=stops)
    timing = timings(runs)
    chains = {name: shape for name, shape in methods.items() if shape}
    best = max(chains, key=lambda name: timing[name]["speedup"])
    return {"timing": timing, "tau": {name: acceptance_stats(runs[name].accepted, shape.num_steps)["tau"] for name, shape in chains.items()},
            "costs": {name: step_costs(graphs, drafter, prompts, size, shape) for name, shape in chains.items()},
            "best": chains[best].num_steps}


def step_costs(graphs: DecodeGraphs | None, drafter, prompts: Sequence[torch.Tensor], batch_size: int, shape: TreeShape) -> dict:
    """With graphs: a proposal's and a verify forward's time over a 1-token verifier forward, at the
    batches' rows, each graph replayed alone: {"draft_cost", "draft_step_cost" (per drafter step),
    "verify_cost"}; eager: {}.

    Why beside τ: speedup ≈ τ / (verify_cost + draft_cost) against plain decoding at the same batch,
    so the two say whether a low speedup is the drafter's acceptance or its price.
    """
    if graphs is None:
        return {}
    rows = graph_rows(len(prompts), batch_size)
    forward = graphs.replay_seconds(graphs.verifier_key(rows, 1))
    draft = graphs.replay_seconds(graphs.draft_key(drafter, shape, rows))
    verify = graphs.replay_seconds(graphs.verifier_key(rows, shape.num_draft_tokens))
    if None in (forward, draft, verify):  # every answer ended before a second round: no draft graph was needed
        return {}
    return {"draft_cost": draft / forward, "draft_step_cost": draft / forward / shape.num_steps, "verify_cost": verify / forward}


# --- output ----------------------------------------------------------------------------------------


def log_report(live, name: str, report: dict) -> None:
    """Metrics ``<set>/...`` and the acceptance, τ and speedup plots of one eval set (the one place that names them).

    Timings are metrics only with their spread (``repeats`` > 1): a speedup measured once is not
    comparable between runs. The headline ``speedup`` is the first batch size's; ``batch/<B>/`` has each.
    """
    plain, chain = report["plain"], report["chain"]
    for key in ("prompts", "tokens", "timed_prompts"):
        live.log_metric(f"{name}/{key}", plain[key], plot=False)
    live.log_metric(f"{name}/seconds", round(plain["seconds"], 2), plot=False)
    methods = {"chain": "", "tree": "tree/"}
    for method, prefix in methods.items():
        for key in ("tau", "lossless", "forwards", "draft_cost", "draft_step_cost", "verify_cost"):
            if key in report.get(method, {}):
                live.log_metric(f"{name}/{prefix}{key}", round(report[method][key], 4), plot=False)
    for method in ("baseline", "ngram"):
        if method in report:
            live.log_metric(f"{name}/{method}/tau", round(report[method]["tau"], 4), plot=False)
    if "ngram" in report:
        for key in ("tau_matched_rounds", "matched_rounds"):
            live.log_metric(f"{name}/ngram/{key}", round(report["ngram"][key], 4), plot=False)
    if "baseline" in report:
        live.log_metric(f"{name}/baseline/token", report["baseline"]["token"], plot=False)
    headline = next(iter(report["batch"].values()))  # the first batch size's
    if headline["plain"]["tokens_per_s_spread"] is not None:
        log_timing(live, f"{name}/", headline, methods)
        for size, timing in report["batch"].items():
            log_timing(live, f"{name}/batch/{size}/", timing, {"chain": "chain/", "tree": "tree/"})
        live.log_metric(f"{name}/unstable", bool(report["unstable"]), plot=False)
    if "chain_k" in report:
        log_chain_sweep(live, f"{name}/chain_k/", report["chain_k"])
    log_plots(live, name, report)


def log_timing(live, prefix: str, timing: dict, methods: Mapping[str, str]) -> None:
    """One batch size's ``timings``: plain tokens/s, and tokens/s and speedup per method, each with its spread."""
    for key in ("tokens_per_s", "tokens_per_s_spread"):
        live.log_metric(f"{prefix}plain_{key}", round(timing["plain"][key], 4), plot=False)
    for method, sub in methods.items():
        for key in ("tokens_per_s", "tokens_per_s_spread", "speedup", "speedup_spread"):
            if method in timing:
                live.log_metric(f"{prefix}{sub}{key}", round(timing[method][key], 4), plot=False)


def log_chain_sweep(live, prefix: str, sweep: dict) -> None:
    """``chain_sweep``'s τ, costs and (with a spread) speedups per K, and the best K."""
    for method, tau in sweep["tau"].items():
        live.log_metric(f"{prefix}{method}/tau", round(tau, 4), plot=False)
        for key, value in sweep["costs"][method].items():
            live.log_metric(f"{prefix}{method}/{key}", round(value, 4), plot=False)
        if sweep["timing"][method]["speedup_spread"] is not None:
            for key in ("speedup", "speedup_spread"):
                live.log_metric(f"{prefix}{method}/{key}", round(sweep["timing"][method][key], 4), plot=False)
    if sweep["timing"]["plain"]["tokens_per_s_spread"] is not None:
        live.log_metric(f"{prefix}best", sweep["best"], plot=False)


def log_plots(live, name: str, report: dict) -> None:
    """Acceptance per draft position, the τ distribution and speedup per batch size: a series per method."""
    chain = report["chain"]
    series = {"drafter": "chain", "tree": "tree", "baseline": "baseline", "ngram": "ngram"}
    series = {column: report[method] for column, method in series.items() if method in report}
    depth = max(len(s["acceptance"]) for s in series.values())

    def column(values: list[float], i: int) -> float:
        return values[i] if i < len(values) else 0.0  # a shallower method accepts nothing that deep

    rows = [{"position": i + 1, "conditional": column(chain["conditional"], i),
             **{c: column(s["acceptance"], i) for c, s in series.items()}} for i in range(depth)]
    live.log_plot(f"acceptance/{name}", rows, x="position", y="drafter")  # rendering is declared in dvc.yaml
    rows = [{"tau": i + 1, **{c: column(s["tau_distribution"], i) for c, s in series.items()}} for i in range(depth + 1)]
    live.log_plot(f"tau/{name}", rows, x="tau", y="drafter")
    rows = [{"batch_size": size, **{column: timing[method]["speedup"] for column, method in (("drafter", "chain"), ("tree", "tree"))
                                    if method in timing}} for size, timing in report["batch"].items()]
    live.log_plot(f"speedup/{name}", rows, x="batch_size", y="drafter")


def warm_up(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
            graphs: DecodeGraphs | None = None, row_counts: Sequence[int] = (),
            methods: Mapping[str, TreeShape | None] | None = None) -> None:
    """A short untimed decode of every method on the first batch, so one-off setup costs (allocator,
    kernels, first calls) are timed in no method.

    Its prompts are cut to their last WARMUP_PROMPT_TOKENS: a whole prompt's prefill costs more
    than the rest of the warm-up (about 1.5 s of the demo's) and sets up nothing a short one does not.
    With ``graphs``, every batch row count in ``row_counts`` is warmed up with ``methods`` (default
    ``settings.methods()``), each for two rounds whatever is accepted (the second captures the
    drafter's graph): graphs are per row count and shape.
    """
    if graphs is None:
        first = [p[-WARMUP_PROMPT_TOKENS:] for p in prompts[: settings.batch_sizes[0]]]
        decode_all(verifier, drafter, first, settings, eos_ids, settings.batch_sizes[0], max_new_tokens=WARMUP_TOKENS)
        return
    methods = methods or settings.methods()
    tokens = min(WARMUP_TOKENS + max(shape.num_steps + 1 for shape in methods.values() if shape), settings.max_new_tokens)
    for rows in row_counts:
        first = [prompts[i % len(prompts)][-WARMUP_PROMPT_TOKENS:] for i in range(rows)]
        decode_all(verifier, drafter, first, settings, eos_ids, rows, methods, max_new_tokens=tokens, graphs=graphs)


def decode_graphs(settings: Settings, eval_sets: Mapping[str, Sequence[torch.Tensor]]) -> DecodeGraphs | None:
    """CUDA graphs for decoding on a GPU with a whole verifier per process (as engines serve); None: eager.

    Why not on the CPU: a CPU has no launch cost to save, and its measurement stays as it was.
    """
    if not (settings.cuda_graphs and settings.device.startswith("cuda")) or settings.placement.sharded:
        return None
    longest = max(len(p) for prompts in eval_sets.values() for p in prompts)
    return DecodeGraphs(longest, settings.max_new_tokens, capture=True)


def graph_rows(count: int, batch_size: int) -> int:
    """The rows of every batch of ``count`` prompts decoded ``batch_size`` at a time with graphs (captured per row count)."""
    return min(count, batch_size)


def evaluate(verifier, drafter, eval_sets: Mapping[str, Sequence[torch.Tensor]], settings: Settings,
             eos_ids: set[int], stops: StopStrings | None = None) -> dict[str, dict]:
    """The stage's work on loaded models: each set's report (``evaluate_set``), from prompts [n] each.

    One warm-up on the first set comes first; the sets need none of their own. The chain K sweep
    (``chain_sweep``) runs on the first set.
    """
    graphs = decode_graphs(settings, eval_sets)
    counts = sorted({graph_rows(len(timed_prompts(prompts, settings)), size) for prompts in eval_sets.values()
                     for size in settings.batch_sizes} | {graph_rows(len(prompts), max(settings.batch_sizes)) for prompts in eval_sets.values()})
    first = next(iter(eval_sets.values()))
    warm_up(verifier, drafter, first, settings, eos_ids, graphs, counts)
    if graphs is not None and settings.chain_sweep:  # the sweep's chains: the first set at the first batch size
        rows = graph_rows(len(timed_prompts(first, settings)), settings.batch_sizes[0])
        warm_up(verifier, drafter, first, settings, eos_ids, graphs, [rows], settings.chain_methods())
    reports = {}
    for index, (name, prompts) in enumerate(eval_sets.items()):
        reports[name] = report = evaluate_set(verifier, drafter, prompts, settings, eos_ids, graphs, index == 0, stops)
        log.info("%s: chain tau %.3f, speedup %.2fx at batch %d; tree tau %s; baselines tau %s (most frequent), %s (ngram); "
                 "%d prompts in %.1f s", name, report["chain"]["tau"], report["batch"][settings.batch_sizes[0]]["chain"]["speedup"],
                 settings.batch_sizes[0],
                 report.get("tree", {}).get("tau", "-"), report.get("baseline", {}).get("tau", "-"),
                 report.get("ngram", {}).get("tau", "-"), len(prompts), report["plain"]["seconds"])
    return reports


def load_models(verifier_dir: Path, drafter_dir: Path, settings: Settings):
    """(verifier, drafter, tokenizer) on the settings' device, set up for decoding."""
    configure_torch(settings)
    verifier = load_verifier(verifier_dir, settings.device, settings.dtype, settings.trust_remote_code, settings.placement)
    embed = input_embedding(verifier)
    drafter = load_drafter(drafter_dir, embed).to(settings.device, embed.dtype).eval()
    for_decoding(verifier, drafter, settings)
    return verifier, drafter, load_tokenizer(verifier_dir, settings.trust_remote_code)


def configure_torch(settings: Settings) -> None:
    torch.set_num_threads(settings.threads)
    if settings.device.startswith("cuda"):
        # cuDNN's SDPA pays a setup per new shape (measured ~10 s per 256 prompts on an H200), and every
        # verify forward here has a new key length; the other SDPA kernels have none.
        torch.backends.cuda.enable_cudnn_sdp(False)


def for_decoding(verifier, drafter, settings: Settings) -> None:
    """The few-row matmuls of decoding, the fast way round on the CPU (``skinny_matmuls``)."""
    if settings.device == "cpu" and not settings.placement.sharded:
        skinny_matmuls(verifier), skinny_matmuls(drafter)


def write_reports(out: Path, reports: dict[str, dict], wall_seconds: float) -> None:
    from dvclive import Live

    with atomic_dir(out) as tmp:
        live = Live(str(tmp), dvcyaml=False, save_dvc_exp=False)
        for name, report in reports.items():
            log_report(live, name, report)
        live.log_metric("wall_seconds", round(wall_seconds, 1), plot=False)
        live.end()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("drafter", type=Path, help="exported drafter folder, e.g. models/drafter")
    parser.add_argument("prompts", type=Path, help="prompts folder with eval/<set>.jsonl, e.g. data/prompts")
    parser.add_argument("out", type=Path, help="dvclive folder for metrics and plots, e.g. dvclive/evaluate")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    settings = Settings.from_params(stage_params(PARAMS, args.params))
    check_pair(args.verifier, args.drafter, args.prompts)
    records = load_eval_sets(args.prompts, settings.sets, settings.max_prompts)
    settings.placement.check(text_config(args.verifier, settings.trust_remote_code), settings.device)
    if settings.placement.launch("eagle3.evaluate", argv):
        return
    # Sharded: every process decodes every prompt in lockstep (each verifier forward is collective;
    # the replicated logits and drafter give every process the same decisions); rank 0 writes.
    verifier, drafter, tokenizer = load_models(args.verifier, args.drafter, settings)
    eval_sets = {name: [torch.tensor(prompt_ids(tokenizer, r["messages"]), device=settings.device) for r in rows]  # [n] each
                 for name, rows in records.items()}
    stops = StopStrings(tokenizer, settings.stop) if settings.stop else None
    reports = evaluate(verifier, drafter, eval_sets, settings, eos_token_ids(verifier, tokenizer), stops)
    if shard_rank() == 0:
        write_reports(args.out, reports, time.perf_counter() - started)
    close_sharded()


if __name__ == "__main__":
    stage_main(main)
