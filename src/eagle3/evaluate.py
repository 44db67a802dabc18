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
``prompts``, ``timed_prompts``, ``seconds``, ``outside_draft_vocab`` (the share of the answers' tokens the
drafter cannot propose); a multi-turn set's ``turn<n>/{prompts, forwards, tau,
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
from pathlib import Path

import torch

from eagle3.common import atomic_dir
from eagle3.decoding.evaluation import Conversations, evaluate
from eagle3.decoding.inputs import check_pair, load_eval_sets
from eagle3.decoding.report import log_report
from eagle3.decoding.session import Session, for_decoding
from eagle3.decoding.settings import PARAMS, Settings  # PARAMS: = dvc.yaml's params of evaluate
from eagle3.decoding.speculative import StopStrings
from eagle3.drafter.export import load_drafter
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import (close_sharded, eos_token_ids, input_embedding, load_tokenizer, load_verifier, prepare_torch,
                               shard_rank, text_config)
from eagle3.settings import stage_params


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
