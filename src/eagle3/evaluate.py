"""Stage ``evaluate``: the drafter's measured acceptance length τ and speedup, by real speculative decoding.

    python -m eagle3.evaluate models/verifier models/drafter data/prompts dvclive/evaluate
    # reads params.yaml: evaluate, layout.device/dtype/threads/verifier, model.stop, model.trust_remote_code

Why: training accuracy is a proxy; a drafter is judged by τ (tokens per verifier forward) and the
speedup it gives, with the drafting SGLang and vLLM serve: a chain of K drafts, and SGLang's draft
tree. The drafter is loaded from its export (``load_drafter``), never from training objects, so a
broken export shows up here as τ ≈ the baselines'.

For each eval set (``data/prompts/eval/<set>.jsonl``, rendered with the chat template and the
generation prompt), τ is decoded once over every prompt at the largest batch size of
``evaluate.batch_sizes`` (``eagle3.decoding.speculative``), chain and tree drafting, answers of
``max_new_tokens``; a record's ``followups`` (MT-bench's second turns) are asked after the verifier's
own answer and decoded the same way (``Conversations``), the set's τ pooling its turns. Every batch
size is then timed: plain greedy decoding, chain and tree drafting, alternately per batch,
``evaluate.repeats`` times each, on the first max(``timed_prompts``, size) prompts for
``timed_new_tokens`` each; where that covers every prompt and token, the τ decode is the timing.
Speedup = tokens/s over plain greedy decoding at the same batch size and repeat: median and spread
over repeats (``eagle3.decoding.timing``).
On a GPU the steps are CUDA graphs over static caches (``eagle3.decoding.graphed``), as engines
serve; answers end at EOS, ``max_new_tokens`` or a ``model.stop`` string. Two baselines are
replayed on the greedy output (exact under greedy verification, and free;
``eagle3.decoding.baselines``): the set's most frequent output token K times (the best
context-free chain drafter), and prompt lookup (``ngram``, as vLLM and SGLang ship it). A drafter
near the baselines' τ is broken.

Output (dvclive, ``dvcyaml=False``), written by ``log_report`` alone: ``metrics.json`` with
``wall_seconds`` and per set ``tau``, ``tau_by_position/<bucket>`` (``evaluate.position_buckets``),
``lossless`` (fraction of the timed prompts whose output equals plain greedy), ``forwards`` (the
chain's), ``tree/{tau, tau_by_position, lossless, forwards}``, ``baseline/{tau, tau_by_position,
token}``, ``ngram/{tau, tau_by_position, tau_matched_rounds, matched_rounds}``, ``tokens``,
``prompts``, ``timed_prompts``, ``seconds``; a multi-turn set's ``turn<n>/{prompts, forwards, tau,
tree/tau, ngram/tau, baseline/tau}``; with graphs ``draft_cost``, ``draft_step_cost``, ``verify_cost``
(and the tree's) and, with a ``chain_sweep``, per set ``chain_k/k<K>/...`` and ``chain_k/best``; with
repeats > 1 the timings: ``speedup``,
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
from eagle3.decoding.graphed import DecodeGraphs
from eagle3.decoding.skinny import skinny_matmuls
from eagle3.decoding.speculative import StopStrings
from eagle3.decoding.acceptance import acceptance_stats, tau_by_position
from eagle3.decoding.baselines import baselines
from eagle3.decoding.settings import Settings
from eagle3.decoding.timing import (UNSTABLE_SPREAD, Run, chain_sweep, decode_all, decode_graphs, disagreeing, graph_rows,
                                       step_costs, timed_prompts, timings, warm_up)
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import (close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier, shard_rank,
                                      text_config)
from eagle3.lm.spec import require_verifier
from eagle3.lm.tokenizer_id import tokenizer_fingerprint

log = logging.getLogger(__name__)

PARAMS = ("evaluate", "layout.device", "layout.dtype", "layout.threads", "layout.verifier", "model.stop",
          "model.trust_remote_code")  # = dvc.yaml


# --- inputs ----------------------------------------------------------------------------------------


def load_eval_sets(prompts_dir: Path, sets: Sequence[str], max_prompts: int | None) -> dict[str, list[dict]]:
    """Prompt records of each set, at most ``max_prompts`` each (file order); ``followups``, where a record
    has them, checked to be later user turns (strings)."""
    loaded = {}
    for name in sets:
        path = prompts_dir / "eval" / f"{name}.jsonl"
        if not path.is_file():
            raise UserError(f"{path}: eval set {name!r} not found; list only sets of dataset.eval_sets in evaluate.sets")
        records = list(read_jsonl(path))[:max_prompts]
        if not records:
            raise UserError(f"{path}: no prompts; the prompts stage wrote an empty eval set")
        for record in records:
            followups = record.get("followups", [])
            if not (isinstance(followups, list) and all(isinstance(f, str) and f for f in followups)):
                raise UserError(f"{path}: record {record.get('id')!r}: followups must be a list of user turns (non-empty "
                                f"strings), got {followups!r}; rerun prompts")
        loaded[name] = records
    return loaded


class Conversations:
    """The later user turns of a multi-turn eval set (its records' ``followups``), each asked after the
    verifier's own answer to the turn before.

        turn2 = conversations.next_turn(answers)   # prompts [n] of the records with a followup left

    Why the drafted answer: greedy speculative decoding emits the verifier's greedy answer (the
    chain's outputs equal plain decoding's, ``lossless``), so the next turn follows what the verifier
    itself answered, as MT-bench's second turns do, with no decode of its own.
    """

    ANSWER_MARGIN = 16  # tokens an answer's text may take beyond the decoded ones when rendered again

    def __init__(self, tokenizer, records: Sequence[dict], device: str, stops: StopStrings | None = None):
        self.tokenizer, self.device, self.stops = tokenizer, device, stops
        self.chats = [list(r["messages"]) for r in records]
        self.followups = [list(r.get("followups", [])) for r in records]
        self.asked = list(range(len(records)))  # the records of the turn decoded last
        self.done = 0  # followups asked so far

    @property
    def turns(self) -> int:
        return 1 + max(map(len, self.followups), default=0)

    def rows(self, turn: int) -> int:
        """Prompts of turn ``turn`` (1: every record)."""
        return sum(len(f) >= turn - 1 for f in self.followups)

    def longest_prompt(self, max_new_tokens: int) -> int:
        """At most the tokens of any turn's prompt: the whole conversation rendered with empty answers,
        plus each answer's ``max_new_tokens`` (and ANSWER_MARGIN)."""
        longest = 0
        for chat, followups in zip(self.chats, self.followups):
            turns = [m for f in followups for m in ({"role": "assistant", "content": ""}, {"role": "user", "content": f})]
            longest = max(longest, len(prompt_ids(self.tokenizer, chat + turns)) + len(followups) * (max_new_tokens + self.ANSWER_MARGIN))
        return longest

    def answer_text(self, tokens: list[int]) -> str:
        """An answer as the next turn's history holds it: its text, without special tokens or a closing stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for stop in self.stops.strings if self.stops else ():
            text = text.split(stop)[0]
        return text

    def next_turn(self, answers: Sequence[list[int]]) -> list[torch.Tensor]:
        """Prompts [n] of the next turn, from the answers to the last one (in its order): each conversation
        that has another followup, with its answer and that followup appended, under the chat template."""
        asked = []
        for record, answer in zip(self.asked, answers, strict=True):
            self.chats[record].append({"role": "assistant", "content": self.answer_text(answer)})
            if len(self.followups[record]) > self.done:
                self.chats[record].append({"role": "user", "content": self.followups[record][self.done]})
                asked.append(record)
        self.asked, self.done = asked, self.done + 1
        return [torch.tensor(prompt_ids(self.tokenizer, self.chats[r]), device=self.device) for r in asked]


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


def lossless(run: Run, plain: Run) -> float:
    """The share of a speculative run's outputs equal to the plain greedy run's (same prompts, same budget)."""
    share = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / len(plain.outputs)
    if share < 1:
        log.warning("%.0f%% of outputs differ from plain greedy decoding (numerical ties, or a bug)", 100 * (1 - share))
    return share


def timed_with_tau(prompts: Sequence[torch.Tensor], settings: Settings) -> bool:
    """Whether the largest batch size's timing is the τ decode itself: it times every prompt, every token."""
    largest = max(settings.batch_sizes)
    return len(timed_prompts(prompts, settings, largest)) == len(prompts) and settings.timed_tokens == settings.max_new_tokens


def evaluate_set(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
                 graphs: DecodeGraphs | None = None, stops: StopStrings | None = None,
                 conversations: Conversations | None = None) -> dict:
    """τ of the chain and the tree (and the baselines) over every prompt and every turn, and the timings of
    plain vs chain vs tree decoding: {"plain": the set's counts, "chain", "tree"?, "baseline"?, "ngram"?,
    "turns"?: {n: τ per method}, "batch": {batch size: ``timings``}, "unstable": [...], "chain_k"?: ``chain_sweep``}.

    τ is decoded once, at the largest batch size, over every prompt (``max_new_tokens`` each); a
    multi-turn set's later turns (``conversations``) follow, each after the chain's answers to the
    one before, and its τ pools every turn's forwards. Every batch size is timed ``repeats`` times
    on its ``timed_prompts`` (``timed_tokens`` each), plain decoding beside the drafting methods;
    ``lossless`` compares their outputs at the largest size. Where that timing covers every prompt
    and token (the demo), it is the τ decode itself: one decode in all.
    """
    start = time.perf_counter()
    largest, edges = max(settings.batch_sizes), settings.position_buckets

    def decode(batch: Sequence[torch.Tensor], size: int, methods: Mapping, repeats: int = 1, tokens: int | None = None) -> dict[str, Run]:
        return decode_all(verifier, drafter, batch, settings, eos_ids, size, methods, repeats, tokens, graphs, stops)

    timed = {}  # batch size -> the runs of its timing
    if timed_with_tau(prompts, settings):
        tau_runs = timed[largest] = decode(prompts, largest, settings.methods(), settings.repeats)
    else:
        tau_runs = decode(prompts, largest, settings.drafting_methods())
    turns = [(prompts, tau_runs)]
    while conversations is not None and (later := conversations.next_turn(turns[-1][1]["chain"].outputs)):
        turns.append((later, decode(later, largest, settings.drafting_methods())))
    for size in settings.batch_sizes:
        if size not in timed:
            timed[size] = decode(timed_prompts(prompts, settings, size), size, settings.methods(), settings.repeats,
                                 settings.timed_tokens)
    every_prompt = [p for batch, _ in turns for p in batch]
    answers = [a for _, runs in turns for a in runs["chain"].outputs]  # the verifier's greedy answers
    headline_timed = timed_prompts(prompts, settings, settings.batch_sizes[0])
    report = {"plain": {"tokens": sum(map(len, answers)), "prompts": len(prompts), "timed_prompts": len(headline_timed)}}
    for name, shape in settings.drafting_methods().items():
        accepted = [a for _, runs in turns for a in runs[name].accepted]
        report[name] = {**acceptance_stats([j for a in accepted for j in a], shape.num_steps),
                        "tau_by_position": tau_by_position(accepted, edges), "lossless": lossless(timed[largest][name], timed[largest]["plain"])}
        report[name].update(step_costs(graphs, drafter, headline_timed, settings.batch_sizes[0], shape))
    if settings.baseline:
        report.update(baselines(every_prompt, answers, settings.draft_tokens, edges))
    if len(turns) > 1:  # published multi-turn τ pools the turns (as above); each turn's own beside it
        token = report.get("baseline", {}).get("token")
        report["turns"] = {n: turn_report(batch, runs, settings, token) for n, (batch, runs) in enumerate(turns, 1)}
    report["batch"] = {size: timings(timed[size]) for size in settings.batch_sizes}
    if settings.chain_sweep:  # per set: the K that pays differs with what is decoded (code, math, chat)
        report["chain_k"] = chain_sweep(verifier, drafter, headline_timed, settings, eos_ids, graphs, stops)
    report["unstable"] = [f"batch {size}: {what}" for size, timing in report["batch"].items() for what in disagreeing(timing)]
    report["unstable"] += [f"chain K sweep: {what}" for what in disagreeing(report.get("chain_k", {}).get("timing", {}))]
    if report["unstable"]:
        log.warning("repeated timings disagree by more than %d%% (%s): a varying load; these speedups do not repeat",
                    100 * UNSTABLE_SPREAD, ", ".join(report["unstable"]))
    report["plain"]["seconds"] = time.perf_counter() - start
    return report


def turn_report(prompts: Sequence[torch.Tensor], runs: Mapping[str, Run], settings: Settings, token: int | None) -> dict:
    """One turn of a multi-turn set: its prompts and τ (and forwards) per drafting method, τ per baseline."""
    report: dict = {"prompts": len(prompts)}
    for name, shape in settings.drafting_methods().items():
        stats = acceptance_stats(runs[name].pooled, shape.num_steps)
        report[name] = {"tau": stats["tau"], "forwards": stats["forwards"]}
    if settings.baseline:
        found = baselines(prompts, runs["chain"].outputs, settings.draft_tokens, token=token)
        report.update({name: {"tau": found[name]["tau"]} for name in ("baseline", "ngram")})
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
             eos_ids: set[int], stops: StopStrings | None = None,
             conversations: Mapping[str, Conversations] | None = None) -> dict[str, dict]:
    """The stage's work on loaded models: each set's report (``evaluate_set``), from prompts [n] each;
    ``conversations``: the later turns of the multi-turn sets, by set.

    One warm-up on the first set comes first; the sets need none of their own.
    """
    conversations = conversations or {}
    largest = max(settings.batch_sizes)
    longest = max([len(p) for prompts in eval_sets.values() for p in prompts] +
                  [c.longest_prompt(settings.max_new_tokens) for c in conversations.values()])
    graphs = decode_graphs(settings, longest)
    counts = {graph_rows(len(timed_prompts(prompts, settings, size)), size) for prompts in eval_sets.values()
              for size in settings.batch_sizes} | {graph_rows(len(prompts), largest) for prompts in eval_sets.values()}
    counts |= {graph_rows(c.rows(turn), largest) for c in conversations.values() for turn in range(2, c.turns + 1)}
    first = next(iter(eval_sets.values()))
    warm_up(verifier, drafter, first, settings, eos_ids, graphs, sorted(counts))
    if graphs is not None and settings.chain_sweep:  # the sweep's chains: every set's timed rows at the first batch size
        size = settings.batch_sizes[0]
        rows = sorted({graph_rows(len(timed_prompts(prompts, settings, size)), size) for prompts in eval_sets.values()})
        warm_up(verifier, drafter, first, settings, eos_ids, graphs, rows, settings.chain_methods())
    reports = {}
    for name, prompts in eval_sets.items():
        reports[name] = report = evaluate_set(verifier, drafter, prompts, settings, eos_ids, graphs, stops, conversations.get(name))
        log.info("%s: chain tau %.3f, speedup %.2fx at batch %d; tree tau %s; baselines tau %s (most frequent), %s (ngram); "
                 "%d prompts%s in %.1f s", name, report["chain"]["tau"], report["batch"][settings.batch_sizes[0]]["chain"]["speedup"],
                 settings.batch_sizes[0],
                 report.get("tree", {}).get("tau", "-"), report.get("baseline", {}).get("tau", "-"),
                 report.get("ngram", {}).get("tau", "-"), len(prompts),
                 f" ({len(report['turns'])} turns)" if "turns" in report else "", report["plain"]["seconds"])
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
    conversations = {name: Conversations(tokenizer, rows, settings.device, stops) for name, rows in records.items()
                     if any(r.get("followups") for r in rows)}
    reports = evaluate(verifier, drafter, eval_sets, settings, eos_token_ids(verifier, tokenizer), stops, conversations)
    if shard_rank() == 0:
        write_reports(args.out, reports, time.perf_counter() - started)
    close_sharded()


if __name__ == "__main__":
    stage_main(main)
