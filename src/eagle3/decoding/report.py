"""``evaluate``'s metrics and plots of one eval set, from its report (``evaluation.evaluate_set``):
the one place that names them (the stage's docstring lists them); and the headline numbers read
back from them (``eval_set_headline``, what ``eagle3.summary`` and the recipe sweep compare).

    log_report(live, "humaneval", report)   # live: a dvclive.Live
    eval_set_headline(read_json("dvclive/evaluate/metrics.json")["humaneval"])   # {"tau": 2.1, ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DIGITS = 4  # rounding of the headline's ratios: differences below it are noise at the demo's scale



def log_report(live, name: str, report: dict) -> None:
    """Metrics ``<set>/...`` and the acceptance, τ and speedup plots of one eval set (the one place that names them).

    Timings are metrics only with their spread (``repeats`` > 1): a speedup measured once is not
    comparable between runs. The headline ``speedup`` is the first batch size's; ``batch/<B>/`` has each.
    Every method's results carry their own ``tau`` (the chain's are the set's own keys, the others'
    under the method's name); ``batch/`` and ``chain_k/`` only detail them and have none: that is how
    ``eagle3.summary`` tells the headline numbers (``has_tau``).
    """
    plain = report["plain"]
    for key in ("prompts", "tokens", "timed_prompts"):
        live.log_metric(f"{name}/{key}", plain[key], plot=False)
    live.log_metric(f"{name}/seconds", round(plain["seconds"], 2), plot=False)
    live.log_metric(f"{name}/outside_draft_vocab", round(plain["outside_draft_vocab"], 4), plot=False)
    methods = {"chain": "", "tree": "tree/"}
    for method, prefix in methods.items():
        for key in ("tau", "lossless", "forwards", "draft_cost", "draft_step_cost", "verify_cost"):
            if key in report.get(method, {}):
                live.log_metric(f"{name}/{prefix}{key}", round(report[method][key], 4), plot=False)
    for method in ("baseline", "ngram"):
        if method in report:
            live.log_metric(f"{name}/{method}/tau", round(report[method]["tau"], 4), plot=False)
    for method, prefix in {**methods, "baseline": "baseline/", "ngram": "ngram/"}.items():
        for bucket, tau in report.get(method, {}).get("tau_by_position", {}).items():
            live.log_metric(f"{name}/{prefix}tau_by_position/{bucket}", round(tau, 4), plot=False)
    for turn, row in report.get("turns", {}).items():
        live.log_metric(f"{name}/turn{turn}/prompts", row["prompts"], plot=False)
        live.log_metric(f"{name}/turn{turn}/forwards", row["chain"]["forwards"], plot=False)
        for method, prefix in {**methods, "baseline": "baseline/", "ngram": "ngram/"}.items():
            if method in row:
                live.log_metric(f"{name}/turn{turn}/{prefix}tau", round(row[method]["tau"], 4), plot=False)
    if "ngram" in report:
        for key in ("tau_matched_rounds", "matched_rounds"):
            live.log_metric(f"{name}/ngram/{key}", round(report["ngram"][key], 4), plot=False)
    if "baseline" in report:
        live.log_metric(f"{name}/baseline/token", report["baseline"]["token"], plot=False)
    headline = next(iter(report["batch"].values()), None)  # the first batch size's; None: nothing timed (repeats 0)
    if headline and headline["plain"]["tokens_per_s_spread"] is not None:
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
    if rows:
        live.log_plot(f"speedup/{name}", rows, x="batch_size", y="drafter")


def has_tau(value: Any) -> bool:
    """Whether a value of evaluate's metrics is a result: an eval set, or a method or turn within one
    (``tree``, ``baseline``, ``ngram``, ``turn2``). evaluate gives each its own ``tau``; what only details
    one (``batch``: the timings per batch size, ``chain_k``: the chain K sweep, ``tau_by_position``) has
    none, and ``wall_seconds`` is a number."""
    return isinstance(value, dict) and "tau" in value


def eval_set_headline(report: dict[str, Any]) -> dict[str, float]:
    """``tau``, ``<method>_tau`` and, where timed with a spread, ``speedup``, ``speedup_spread``,
    ``<method>_speedup``, ``<method>_speedup_spread`` and ``unstable`` of one eval set of evaluate's
    metrics: its own keys and those of its methods (``has_tau``); ``outside_draft_vocab`` where measured (what a
    draft vocabulary variant changes).

    Example: {"tau": 2.1, "speedup": 1.4, "speedup_spread": 0.02, "unstable": false, "prompts": 4,
    "tree": {"tau": 2.5, "speedup": 1.5, "speedup_spread": 0.03, "forwards": 9}, "baseline": {"tau": 1.2,
    "token": 28}} -> {"tau": 2.1, "speedup": 1.4, "speedup_spread": 0.02, "unstable": 0, "tree_tau": 2.5,
    "tree_speedup": 1.5, "tree_speedup_spread": 0.03, "baseline_tau": 1.2}; with "tau_by_position":
    {"0-64": 2.3} beside them, also "tau_by_position": {"0-64": 2.3} (and the tree's as "tree_tau_by_position").
    """
    keys = ("tau", "speedup", "speedup_spread")
    row = {key: report[key] for key in (*keys, "unstable", "outside_draft_vocab") if key in report}
    for method, value in report.items():
        if has_tau(value):
            row.update({f"{method}_{key}": value[key] for key in keys if key in value})
    row = {key: round(float(value), DIGITS) if key != "unstable" else int(value) for key, value in row.items()}
    for name, buckets in (("tau_by_position", report.get("tau_by_position")),
                          ("tree_tau_by_position", report.get("tree", {}).get("tau_by_position"))):
        if buckets:
            row[name] = {bucket: round(float(tau), DIGITS) for bucket, tau in buckets.items()}
    return row
