"""Stage ``evaluate``: the drafter's measured acceptance length τ and speedup, by real speculative decoding.

    python -m eagle3.evaluate models/verifier models/drafter data/prompts dvclive/evaluate
    # reads params.yaml: evaluate, layout.device/dtype/threads, model.trust_remote_code

Why: training accuracy is a proxy; a drafter is judged by τ (tokens per verifier forward) and the
speedup it gives. The drafter is loaded from its export (``load_drafter``), never from training
objects, so a broken export shows up here as τ ≈ the baseline's.

For each eval set (``data/prompts/eval/<set>.jsonl``, rendered with the chat template and the
generation prompt), every prompt is decoded on the same device by plain greedy decoding and by
speculative decoding (``eagle3.speculative``), alternately, each timed; the outputs must be
identical. The baseline repeats the speculative run with a drafter that always proposes the most
frequent token of the set's greedy outputs (the best context-free chain drafter for that set).

Output (dvclive, ``dvcyaml=False``): ``metrics.json`` nested per set — ``tau``, ``speedup``,
``tokens_per_s``, ``plain_tokens_per_s``, ``lossless`` (fraction of prompts whose output equals
plain greedy), ``forwards``, ``tokens``, ``prompts`` and ``baseline/{tau, speedup, tokens_per_s,
token}`` — and plots ``plots/custom/acceptance/<set>.json`` (per draft position k: the fraction
of verifier forwards that accepted draft k, hence τ = 1 + Σ_k acceptance_k) and
``plots/custom/tau/<set>.json`` (the distribution of τ over forwards).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import UserError, atomic_dir, load_params, read_json, read_jsonl, stage_main
from eagle3.export import check_drafter, load_drafter
from eagle3.speculative import ConstantDrafter, Decoded, greedy_decode, speculative_decode
from eagle3.verifier import eos_token_ids, load_tokenizer, load_verifier, prompt_ids, read_meta

log = logging.getLogger(__name__)

WARMUP_TOKENS = 4  # a short untimed decode of each kind first, so one-off setup costs are not timed


@dataclass(frozen=True)
class Settings:
    """What ``evaluate`` reads from params: its section and the layout (hardware only)."""

    draft_tokens: int  # K: drafts per verifier forward
    max_new_tokens: int  # tokens generated per prompt (fewer at EOS)
    sets: tuple[str, ...]  # eval sets: data/prompts/eval/<set>.jsonl
    max_prompts: int | None  # at most this many prompts per set (file order); None: all
    baseline: bool  # also measure the most-frequent-token drafter
    device: str
    dtype: str
    threads: int
    trust_remote_code: bool

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        cfg, layout = params.evaluate, params.layout
        settings = cls(
            int(cfg.draft_tokens), int(cfg.max_new_tokens), tuple(cfg.sets),
            None if cfg.max_prompts is None else int(cfg.max_prompts), bool(cfg.baseline),
            str(layout.device), str(layout.dtype), int(layout.threads), bool(params.model.trust_remote_code),
        )
        for key in ("draft_tokens", "max_new_tokens"):
            if getattr(settings, key) < 1:
                raise UserError(f"params.yaml: evaluate.{key} must be >= 1, got {getattr(settings, key)}")
        if not settings.sets:
            raise UserError("params.yaml: evaluate.sets is empty; name at least one eval set (heldout, humaneval)")
        if settings.max_prompts is not None and settings.max_prompts < 1:
            raise UserError(f"params.yaml: evaluate.max_prompts must be >= 1 or null, got {settings.max_prompts}")
        return settings


@dataclass
class Run:
    """One decoding method over one eval set."""

    outputs: list[list[int]] = field(default_factory=list)  # generated tokens per prompt
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verifier forward, pooled over prompts
    seconds: float = 0.0  # decoding time, summed over prompts

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
    verifier = read_meta(verifier_dir)["fingerprint"]["id"]
    prompts = read_json(prompts_dir / "meta.json").get("verifier")
    if prompts != verifier:
        raise UserError(f"{prompts_dir}/meta.json: prompts counted for verifier {prompts}, this verifier is {verifier}; rerun prompts")


# --- measurement -----------------------------------------------------------------------------------


def decode_all(prompts: Sequence[torch.Tensor], methods: dict[str, Callable[[torch.Tensor], Decoded]]) -> dict[str, Run]:
    """Run every method on every prompt, alternating methods per prompt (fair under a varying load)."""
    runs = {name: Run() for name in methods}
    for ids in tqdm(prompts, desc="/".join(methods), unit="prompt", leave=False):
        for name, decode in methods.items():
            start = time.perf_counter()
            decoded = decode(ids)
            runs[name].seconds += time.perf_counter() - start
            runs[name].outputs.append(decoded.tokens)
            runs[name].accepted += decoded.accepted
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


def evaluate_set(verifier, drafter, prompts: Sequence[torch.Tensor], settings: Settings, eos_ids: set[int]) -> dict:
    """Plain vs speculative decoding of ``prompts`` (and the baseline): {"plain", "drafter", "baseline"?}."""
    k, max_new = settings.draft_tokens, settings.max_new_tokens
    layer_ids = drafter.config.aux_layers

    def plain(ids):
        return Decoded(greedy_decode(verifier, ids, max_new, eos_ids))

    def speculative_with(candidate):
        return lambda ids: speculative_decode(verifier, candidate, ids, layer_ids, k, max_new, eos_ids)

    runs = decode_all(prompts, {"plain": plain, "drafter": speculative_with(drafter)})
    report = {"plain": {"tokens_per_s": runs["plain"].tokens_per_s, "tokens": sum(map(len, runs["plain"].outputs)),
                        "prompts": len(prompts)},
              "drafter": summarize(runs["drafter"], runs["plain"], k)}
    if settings.baseline:
        token = most_frequent_token(runs["plain"].outputs)
        baseline = ConstantDrafter(token).to(prompts[0].device)
        base = decode_all(prompts, {"baseline": speculative_with(baseline)})["baseline"]
        report["baseline"] = {**summarize(base, runs["plain"], k), "token": token}
    return report


def warm_up(verifier, drafter, ids: torch.Tensor, settings: Settings, eos_ids: set[int]) -> None:
    greedy_decode(verifier, ids, WARMUP_TOKENS, eos_ids)
    speculative_decode(verifier, drafter, ids, drafter.config.aux_layers, settings.draft_tokens, WARMUP_TOKENS, eos_ids)


# --- output ----------------------------------------------------------------------------------------


def log_report(live, name: str, report: dict) -> None:
    """Metrics ``<set>/...`` and the acceptance and τ plots of one eval set."""
    drafter, baseline = report["drafter"], report.get("baseline")
    live.log_metric(f"{name}/prompts", report["plain"]["prompts"], plot=False)
    live.log_metric(f"{name}/tokens", report["plain"]["tokens"], plot=False)
    live.log_metric(f"{name}/plain_tokens_per_s", round(report["plain"]["tokens_per_s"], 3), plot=False)
    for key in ("tau", "speedup", "tokens_per_s", "lossless", "forwards"):
        live.log_metric(f"{name}/{key}", round(drafter[key], 4), plot=False)
        if baseline and key != "forwards":
            live.log_metric(f"{name}/baseline/{key}", round(baseline[key], 4), plot=False)
    if baseline:
        live.log_metric(f"{name}/baseline/token", baseline["token"], plot=False)
    rows = [{"position": i + 1, "drafter": rate, "conditional": cond,
             **({"baseline": baseline["acceptance"][i]} if baseline else {})}
            for i, (rate, cond) in enumerate(zip(drafter["acceptance"], drafter["conditional"]))]
    live.log_plot(f"acceptance/{name}", rows, x="position", y="drafter")  # rendering is declared in dvc.yaml
    rows = [{"tau": i + 1, "fraction": share, **({"baseline": baseline["tau_distribution"][i]} if baseline else {})}
            for i, share in enumerate(drafter["tau_distribution"])]
    live.log_plot(f"tau/{name}", rows, x="tau", y="fraction")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("drafter", type=Path, help="exported drafter folder, e.g. models/drafter")
    parser.add_argument("prompts", type=Path, help="prompts folder with eval/<set>.jsonl, e.g. data/prompts")
    parser.add_argument("out", type=Path, help="dvclive folder for metrics and plots, e.g. dvclive/evaluate")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    settings = Settings.from_params(load_params(args.params))
    check_pair(args.verifier, args.drafter, args.prompts)
    eval_sets = load_eval_sets(args.prompts, settings.sets, settings.max_prompts)

    from dvclive import Live

    torch.set_num_threads(settings.threads)
    verifier = load_verifier(args.verifier, settings.device, settings.dtype, settings.trust_remote_code)
    tokenizer = load_tokenizer(args.verifier, settings.trust_remote_code)
    embed = verifier.get_input_embeddings().weight
    drafter = load_drafter(args.drafter, embed).to(settings.device, embed.dtype).eval()
    eos_ids = eos_token_ids(verifier, tokenizer)
    with atomic_dir(args.out) as tmp:
        live = Live(str(tmp), dvcyaml=False, save_dvc_exp=False)
        for name, records in eval_sets.items():
            prompts = [torch.tensor([prompt_ids(tokenizer, r["messages"])], device=settings.device) for r in records]  # [1, n] each
            warm_up(verifier, drafter, prompts[0], settings, eos_ids)
            report = evaluate_set(verifier, drafter, prompts, settings, eos_ids)
            log.info("%s: tau %.3f, speedup %.2fx (baseline tau %s), %d prompts", name, report["drafter"]["tau"],
                     report["drafter"]["speedup"], report.get("baseline", {}).get("tau", "-"), len(prompts))
            log_report(live, name, report)
        live.end()


if __name__ == "__main__":
    stage_main(main)
