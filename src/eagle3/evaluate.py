"""Stage ``evaluate``: the drafter's measured acceptance length τ and speedup, by real speculative decoding.

    python -m eagle3.evaluate models/verifier models/drafter data/prompts dvclive/evaluate
    # reads params.yaml: evaluate, layout.device/dtype/threads, model.trust_remote_code

Why: training accuracy is a proxy; a drafter is judged by τ (tokens per verifier forward) and the
speedup it gives, with the drafting SGLang and vLLM serve: a chain of K drafts, and SGLang's draft
tree. The drafter is loaded from its export (``load_drafter``), never from training objects, so a
broken export shows up here as τ ≈ the baselines'.

For each eval set (``data/prompts/eval/<set>.jsonl``, rendered with the chat template and the
generation prompt), the prompts are decoded ``evaluate.batch_size`` at a time (``eagle3.drafter.speculative``)
by plain greedy decoding, chain drafting and tree drafting, alternately per batch, each timed; the
outputs must be identical. Speedup = tokens/s over plain greedy decoding at the same batch size.
Two baselines are replayed on the plain greedy output (exact under greedy verification, and
free): the set's most frequent output token K times (the best context-free chain drafter), and
prompt lookup (``ngram``, as vLLM and SGLang ship it). A drafter near the baselines' τ is broken.

Output (dvclive, ``dvcyaml=False``), written by ``log_report`` alone: ``metrics.json`` with
``wall_seconds`` and per set ``tau``, ``speedup``, ``tokens_per_s``, ``lossless`` (fraction of
prompts whose output equals plain greedy), ``forwards`` (the chain's), ``tree/{tau, speedup,
tokens_per_s, lossless, forwards}``, ``baseline/{tau, token}``, ``ngram/tau``, ``plain_tokens_per_s``,
``tokens``, ``prompts``, ``seconds``; plots ``plots/custom/acceptance/<set>.json`` (per draft
position or tree depth k: the fraction of verifier forwards that accepted k drafts or more, hence
τ = 1 + Σ_k acceptance_k) and ``plots/custom/tau/<set>.json`` (the distribution of τ over forwards);
both with the series ``drafter`` (the chain), ``tree``, ``baseline`` and ``ngram``, which
dvc.yaml's top-level ``plots`` draws in one chart per set.
"""

from __future__ import annotations

import argparse
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
from eagle3.drafter.speculative import (EagleProposer, TreeShape, most_frequent, ngram, prefill, replay, skinny_matmuls,
                                        speculative_decode)
from eagle3.verifiers.chat import prompt_ids
from eagle3.verifiers.loading import (Placement, close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier,
                                      shard_rank, text_config, tokenizer_fingerprint)
from eagle3.verifiers.spec import VerifierSpec, require_verifier

log = logging.getLogger(__name__)

PARAMS = ("evaluate", "layout.device", "layout.dtype", "layout.threads", "layout.verifier", "model.trust_remote_code")  # = dvc.yaml

WARMUP_TOKENS = 2  # the untimed decode of every method before the first set: its prefill and one round (``warm_up``)
WARMUP_PROMPT_TOKENS = 16  # of each warm-up prompt


@dataclass(frozen=True)
class Settings:
    """What ``evaluate`` reads from params: its section and the layout (hardware only)."""

    draft_tokens: int  # K: chain drafts per verifier forward
    tree: TreeShape | None  # SGLang's draft tree (num_steps, topk, num_draft_tokens); None: chain only
    batch_size: int  # prompts decoded together
    max_new_tokens: int  # tokens generated per prompt (fewer at EOS)
    sets: tuple[str, ...]  # eval sets: data/prompts/eval/<set>.jsonl
    max_prompts: int | None  # at most this many prompts per set (file order); None: all
    baseline: bool  # also replay the most-frequent-token and n-gram baselines
    device: str
    dtype: str
    threads: int
    trust_remote_code: bool
    placement: Placement  # layout.verifier: tp > 1 decodes with one copy sharded over tp torchrun processes

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        cfg, layout = params.evaluate, params.layout
        tree = cfg.tree
        return cls(  # values validated by config.validate (stage_params), the tree's shape included
            int(cfg.draft_tokens), None if tree is None else TreeShape(int(tree.num_steps), int(tree.topk), int(tree.num_draft_tokens)),
            int(cfg.batch_size), int(cfg.max_new_tokens), tuple(cfg.sets),
            None if cfg.max_prompts is None else int(cfg.max_prompts), bool(cfg.baseline),
            str(layout.device), str(layout.dtype), int(layout.threads), VerifierSpec.from_params(params.model).trust_remote_code,
            Placement.from_params(layout),
        )

    def methods(self) -> dict[str, TreeShape | None]:
        """Decoding methods: plain greedy (None), the chain, and the tree when configured."""
        return {"plain": None, "chain": TreeShape.chain(self.draft_tokens), **({"tree": self.tree} if self.tree else {})}


@dataclass
class Run:
    """One decoding method over one eval set."""

    outputs: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verifier forward, pooled over prompts
    seconds: float = 0.0  # decoding time, summed over batches

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.outputs)) / self.seconds


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


def decode_all(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int],
               max_new_tokens: int | None = None) -> dict[str, Run]:
    """Every method on every batch of prompts, alternating methods per batch (fair under a varying load).

    The prompts of a batch are prefilled once, untimed, and every method decodes from a copy: the
    prefill is the same work for all of them, so times and speedups are of decoding alone.
    """
    methods = settings.methods()
    runs = {name: Run() for name in methods}
    layer_ids = drafter.config.aux_layers
    for batch in tqdm(batches(prompts, settings.batch_size), desc="/".join(methods), unit="batch", leave=False):
        prefilled = prefill(verifier, batch, layer_ids)
        for name, shape in methods.items():
            proposer = EagleProposer(drafter, shape) if shape else None
            start = time.perf_counter()
            decoded = speculative_decode(verifier, proposer, batch, layer_ids, max_new_tokens or settings.max_new_tokens,
                                         eos_ids, prefilled)
            if str(settings.device).startswith("cuda"):
                torch.cuda.synchronize()
            runs[name].seconds += time.perf_counter() - start
            for d in decoded:
                runs[name].outputs.append(d.tokens)
                runs[name].accepted += d.accepted
    return runs


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
    """τ, acceptance and throughput of a speculative run against the plain greedy run of the same prompts."""
    lossless = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / len(plain.outputs)
    if lossless < 1:
        log.warning("%.0f%% of outputs differ from plain greedy decoding (numerical ties, or a bug)", 100 * (1 - lossless))
    return {**acceptance_stats(run.accepted, k), "tokens_per_s": run.tokens_per_s,
            "speedup": run.tokens_per_s / plain.tokens_per_s, "lossless": lossless}


def baselines(prompts: Sequence[torch.Tensor], outputs: Sequence[list[int]], k: int) -> dict:
    """The most-frequent-token and n-gram baselines, replayed on the plain greedy outputs."""
    token = most_frequent_token(outputs)
    report = {}
    for name, propose in (("baseline", most_frequent(token)), ("ngram", ngram)):
        accepted = [j for ids, out in zip(prompts, outputs) for j in replay(propose, ids.tolist(), out, k)]
        report[name] = acceptance_stats(accepted, k)
    report["baseline"]["token"] = token
    return report


def evaluate_set(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int]) -> dict:
    """Plain vs chain vs tree decoding of ``prompts`` (and the baselines): {"plain", "chain", "tree"?, ...}."""
    start = time.perf_counter()
    runs = decode_all(verifier, drafter, prompts, settings, eos_ids)
    plain = runs.pop("plain")
    report = {"plain": {"tokens_per_s": plain.tokens_per_s, "tokens": sum(map(len, plain.outputs)), "prompts": len(prompts)}}
    for name, run in runs.items():
        report[name] = summarize(run, plain, settings.methods()[name].num_steps)
    if settings.baseline:
        report.update(baselines(prompts, plain.outputs, settings.draft_tokens))
    report["plain"]["seconds"] = time.perf_counter() - start
    return report


# --- output ----------------------------------------------------------------------------------------


def log_report(live, name: str, report: dict) -> None:
    """Metrics ``<set>/...`` and the acceptance and τ plots of one eval set (the one place that names them)."""
    plain, chain = report["plain"], report["chain"]
    live.log_metric(f"{name}/prompts", plain["prompts"], plot=False)
    live.log_metric(f"{name}/tokens", plain["tokens"], plot=False)
    live.log_metric(f"{name}/seconds", round(plain["seconds"], 2), plot=False)
    live.log_metric(f"{name}/plain_tokens_per_s", round(plain["tokens_per_s"], 3), plot=False)
    for method, prefix in (("chain", ""), ("tree", "tree/")):
        for key in ("tau", "speedup", "tokens_per_s", "lossless", "forwards"):
            if method in report:
                live.log_metric(f"{name}/{prefix}{key}", round(report[method][key], 4), plot=False)
    for method in ("baseline", "ngram"):
        if method in report:
            live.log_metric(f"{name}/{method}/tau", round(report[method]["tau"], 4), plot=False)
    if "baseline" in report:
        live.log_metric(f"{name}/baseline/token", report["baseline"]["token"], plot=False)
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


def warm_up(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int]) -> None:
    """A short untimed decode of every method on the first batch, so one-off setup costs (allocator,
    kernels, first calls) are timed in no method.

    Its prompts are cut to their last WARMUP_PROMPT_TOKENS: a whole prompt's prefill costs more
    than the rest of the warm-up (about 1.5 s of the demo's) and sets up nothing a short one does not.
    """
    first = [p[-WARMUP_PROMPT_TOKENS:] for p in prompts[: settings.batch_size]]
    decode_all(verifier, drafter, first, settings, eos_ids, WARMUP_TOKENS)


def evaluate(verifier, drafter, eval_sets: Mapping[str, Sequence[torch.Tensor]], settings: Settings,
             eos_ids: set[int]) -> dict[str, dict]:
    """The stage's work on loaded models: each set's report (``evaluate_set``), from prompts [n] each.

    One warm-up on the first set comes first; the sets need none of their own.
    """
    warm_up(verifier, drafter, next(iter(eval_sets.values())), settings, eos_ids)
    reports = {}
    for name, prompts in eval_sets.items():
        reports[name] = report = evaluate_set(verifier, drafter, prompts, settings, eos_ids)
        log.info("%s: chain tau %.3f, speedup %.2fx; tree tau %s; baselines tau %s (most frequent), %s (ngram); "
                 "%d prompts in %.1f s", name, report["chain"]["tau"], report["chain"]["speedup"],
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
    reports = evaluate(verifier, drafter, eval_sets, settings, eos_token_ids(verifier, tokenizer))
    if shard_rank() == 0:
        write_reports(args.out, reports, time.perf_counter() - started)
    close_sharded()


if __name__ == "__main__":
    stage_main(main)
