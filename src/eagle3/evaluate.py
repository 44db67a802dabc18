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
identical) come from one decode at the largest size. Speedup = tokens/s over plain greedy decoding
at the same batch size and repeat: median and spread over repeats (``eagle3.measurement.timing``).
On a GPU the steps are CUDA graphs over static caches (``eagle3.drafter.graphed``), as engines
serve; answers end at EOS, ``max_new_tokens`` or a ``model.stop`` string. Two baselines are
replayed on the plain greedy output (exact under greedy verification, and free;
``eagle3.measurement.baselines``): the set's most frequent output token K times (the best
context-free chain drafter), and prompt lookup (``ngram``, as vLLM and SGLang ship it). A drafter
near the baselines' τ is broken.

Output (dvclive, ``dvcyaml=False``), written by ``log_report`` alone: ``metrics.json`` with
``wall_seconds`` and per set ``tau``, ``lossless`` (fraction of prompts whose output equals plain
greedy), ``forwards`` (the chain's), ``tree/{tau, lossless, forwards}``, ``baseline/{tau, token}``,
``ngram/{tau, tau_matched_rounds, matched_rounds}``, ``tokens``, ``prompts``, ``seconds``; with graphs
``draft_cost``, ``draft_step_cost``, ``verify_cost`` (and the tree's) and, per set,
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
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from eagle3.common import UserError, atomic_dir, read_json, read_jsonl, stage_main
from eagle3.config import stage_params
from eagle3.drafter.export import check_drafter, load_drafter
from eagle3.drafter.graphed import DecodeGraphs
from eagle3.drafter.skinny import skinny_matmuls
from eagle3.drafter.speculative import StopStrings
from eagle3.measurement.acceptance import acceptance_stats
from eagle3.measurement.baselines import baselines
from eagle3.measurement.settings import Settings
from eagle3.measurement.timing import (UNSTABLE_SPREAD, Run, chain_sweep, decode_all, decode_graphs, disagreeing, graph_rows,
                                       step_costs, timed_prompts, timings, warm_up)
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import (close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier, shard_rank,
                                      text_config)
from eagle3.lm.spec import require_verifier
from eagle3.tokenizer_id import tokenizer_fingerprint

log = logging.getLogger(__name__)

PARAMS = ("evaluate", "layout.device", "layout.dtype", "layout.threads", "layout.verifier", "model.stop",
          "model.trust_remote_code")  # = dvc.yaml


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


def summarize(run: Run, plain: Run, k: int) -> dict:
    """τ and acceptance of a speculative run, and the share of its outputs equal to the plain greedy run's."""
    lossless = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / len(plain.outputs)
    if lossless < 1:
        log.warning("%.0f%% of outputs differ from plain greedy decoding (numerical ties, or a bug)", 100 * (1 - lossless))
    return {**acceptance_stats(run.accepted, k), "lossless": lossless}


def evaluate_set(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
                 graphs: DecodeGraphs | None = None, stops: StopStrings | None = None) -> dict:
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
    if settings.chain_sweep:  # per set: the K that pays differs with what is decoded (code, math, chat)
        report["chain_k"] = chain_sweep(verifier, drafter, timed, settings, eos_ids, graphs, stops)
    report["unstable"] = [f"batch {size}: {what}" for size, timing in report["batch"].items() for what in disagreeing(timing)]
    report["unstable"] += [f"chain K sweep: {what}" for what in disagreeing(report.get("chain_k", {}).get("timing", {}))]
    if report["unstable"]:
        log.warning("repeated timings disagree by more than %d%% (%s): a varying load; these speedups do not repeat",
                    100 * UNSTABLE_SPREAD, ", ".join(report["unstable"]))
    report["plain"]["seconds"] = time.perf_counter() - start
    return report


# --- output ----------------------------------------------------------------------------------------


def log_report(live, name: str, report: dict) -> None:
    """Metrics ``<set>/...`` and the acceptance, τ and speedup plots of one eval set (the one place that names them).

    Timings are metrics only with their spread (``repeats`` > 1): a speedup measured once is not
    comparable between runs. The headline ``speedup`` is the first batch size's; ``batch/<B>/`` has each.
    Every method's results carry their own ``tau`` (the chain's are the set's own keys, the others'
    under the method's name); ``batch/`` and ``chain_k/`` only detail them and have none: that is how
    ``eagle3.summary`` tells the headline numbers (``summary.has_tau``).
    """
    plain = report["plain"]
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


def evaluate(verifier, drafter, eval_sets: Mapping[str, Sequence[torch.Tensor]], settings: Settings,
             eos_ids: set[int], stops: StopStrings | None = None) -> dict[str, dict]:
    """The stage's work on loaded models: each set's report (``evaluate_set``), from prompts [n] each.

    One warm-up on the first set comes first; the sets need none of their own.
    """
    graphs = decode_graphs(settings, eval_sets)
    counts = sorted({graph_rows(len(timed_prompts(prompts, settings)), size) for prompts in eval_sets.values()
                     for size in settings.batch_sizes} | {graph_rows(len(prompts), max(settings.batch_sizes)) for prompts in eval_sets.values()})
    first = next(iter(eval_sets.values()))
    warm_up(verifier, drafter, first, settings, eos_ids, graphs, counts)
    if graphs is not None and settings.chain_sweep:  # the sweep's chains: every set's timed rows at the first batch size
        rows = sorted({graph_rows(len(timed_prompts(prompts, settings)), settings.batch_sizes[0]) for prompts in eval_sets.values()})
        warm_up(verifier, drafter, first, settings, eos_ids, graphs, rows, settings.chain_methods())
    reports = {}
    for name, prompts in eval_sets.items():
        reports[name] = report = evaluate_set(verifier, drafter, prompts, settings, eos_ids, graphs, stops)
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
