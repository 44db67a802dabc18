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
``max_new_tokens`` (in phases of 64, 128, ... tokens, the answers still going regrouped into full batches
each phase, ``decode_tau``); a record's ``followups`` (MT-bench's second turns) are asked after the verifier's
own answer and decoded the same way (``Conversations``), the set's τ pooling its turns. Every batch
size is then timed: plain greedy decoding, chain and tree drafting, alternately per batch,
``evaluate.repeats`` times each, on the first max(``timed_prompts``, size) prompts for
``timed_new_tokens`` each; where that covers every prompt and token, the τ decode is the timing.
With ``repeats`` 0 (``-S evaluate=tau``) nothing is timed: τ alone, as a recipe comparison needs.
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

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.evaluate")

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from eagle3.common import UserError, atomic_dir, read_json, read_jsonl
from eagle3.decoding.config import EvaluateConfig
from eagle3.decoding.evaluation import Conversations, evaluate
from eagle3.decoding.report import log_report
from eagle3.decoding.session import Session, for_decoding
from eagle3.decoding.settings import Settings
from eagle3.decoding.speculative import StopStrings
from eagle3.drafter.export import check_drafter, load_drafter
from eagle3.layout import LayoutSettings
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import (close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier, prepare_torch,
                               shard_rank, text_config)
from eagle3.lm.spec import ModelSettings, require_verifier
from eagle3.lm.tokenizer_id import tokenizer_fingerprint
from eagle3.settings import StageParams, keys_of, section, stage_params

PARAMS = StageParams(section(EvaluateConfig), keys_of(LayoutSettings, "device", "dtype", "threads", "verifier"),  # = dvc.yaml
                     keys_of(ModelSettings, "stop", "trust_remote_code"))


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


def check_pair(verifier_dir: Path, drafter_dir: Path, prompts_dir: Path) -> None:
    """Refuse a drafter export with faults or trained for another verifier, and prompts of another verifier."""
    problems = check_drafter(drafter_dir, verifier_dir)
    if problems:
        raise UserError(f"{drafter_dir}: {problems[0]}" + (f" (and {len(problems) - 1} more; run eagle3 check-drafter)" if len(problems) > 1 else ""))
    tokenizer = tokenizer_fingerprint(verifier_dir)  # not the weights': another machine's import of them differs
    prompts = read_json(prompts_dir / "meta.json").get("tokenizer")
    require_verifier(f"{prompts_dir}/meta.json", "prompts counted with the tokenizer and chat template of", prompts,
                     tokenizer, "this verifier's are", "rerun prompts")


def load_models(verifier_dir: Path, drafter_dir: Path, settings: Settings):
    """(verifier, drafter, tokenizer) on the settings' device, set up for decoding."""
    prepare_torch(settings.device, settings.threads)  # every verify forward has a new key length
    verifier = load_verifier(verifier_dir, settings.device, settings.dtype, settings.trust_remote_code, settings.placement)
    embed = input_embedding(verifier)
    drafter = load_drafter(drafter_dir, embed).to(settings.device, embed.dtype).eval()
    for_decoding(verifier, drafter, settings)
    return verifier, drafter, load_tokenizer(verifier_dir, settings.trust_remote_code)


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
    session = Session.create(verifier, drafter, settings, eos_token_ids(verifier, tokenizer), stops)
    reports = evaluate(session, eval_sets, conversations)
    if shard_rank() == 0:
        write_reports(args.out, reports, time.perf_counter() - started)
    close_sharded()
