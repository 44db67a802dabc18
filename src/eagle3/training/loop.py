"""The training loop: ``train_step`` for every optimizer step, ``validate`` every ``val_every``
steps (keeping a copy of the weights of the best validation on the device), ``save_checkpoint`` every
``checkpoint_every``; resumed from the run folder's last checkpoint.

    summary, best_weights = fit(ttt, head, Splits(train_set, val_set), cfg, Run(run_dir, seed, live), world)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset

import eagle3.training.parallel as parallel
from eagle3.common import Spent
from eagle3.training.checkpoints import resume, save_checkpoint
from eagle3.training.config import TrainConfig
from eagle3.training.data import DataPlan, check_lengths, step_batches
from eagle3.training.loss import TrainingTimeTest, VerifierHead
from eagle3.training.parallel import World
from eagle3.training.resident import on_device
from eagle3.training.reporting import Window, record, replay, train_metrics
from eagle3.training.step import (Optimisation, collate_ttt, compile_step, compiles, graphs, lr_factor, make_optimizers,
                                  to_device, train_step, validate, validation_batches, warmup_steps)

log = logging.getLogger(__name__)

# Fewer optimizer steps than this leave a drafter far below what its data can teach (1k prompts,
# the same tokens: 54 steps held-out chain τ 1.36, 218 steps 2.02, 644 steps 2.37 on one H200).
MIN_STEPS = 500


def largest_compile_timers(count: int = 12) -> str:
    """The compile timers torch.compile kept in this process (tracing, AOT autograd, inductor, Triton), the largest
    first; they nest (a phase's timer includes its parts) and those of parallel compile workers add up (so one can pass
    the wall time). Why: on a fresh GPU host the first step's compilation was the train stage's longest idle stretch
    (49.5-70.3 s of the 10k run), and only these say which phase to shorten."""
    names, seconds = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    largest = sorted(zip(map(float, seconds), names), reverse=True)[:count]
    return ", ".join(f"{name} {value:.1f}" for value, name in largest)


def compile_cache_counts() -> str:
    """Where this process's compiled graphs came from: torch.compile's caches (hits: a compile ahead's,
    ``training.ahead``, or an earlier run's on this host) or a compile here (misses; bypass: not cacheable)."""
    inductor, aot = torch._dynamo.utils.counters["inductor"], torch._dynamo.utils.counters["aot_autograd"]
    return "; ".join(f"{name} {counts[f'{key}_hit']} hits, {counts[f'{key}_miss']} misses, {counts[f'{key}_bypass']} bypassed"
                     for name, counts, key in (("AOT autograd cache", aot, "autograd_cache"), ("FX graph cache", inductor, "fxgraph_cache")))


def warn_if_undertrained(total: int, cfg: TrainConfig) -> None:
    """A loud warning for a run of fewer than ``MIN_STEPS`` steps, with what to change: train.max_steps
    when it caps the run, else the global batch or the epochs."""
    if total >= MIN_STEPS:
        return
    if cfg.max_steps:
        advice = f"train.max_steps (now {cfg.max_steps}) caps the run: raise it, or set it to 0 to run train.epochs"
    else:
        advice = f"Lower train.batch_tokens (now {cfg.batch_tokens}) or raise train.epochs (now {cfg.epochs})"
    log.warning("\n%s\nUNDER-TRAINED: only %d optimizer steps (fewer than %d): the drafter will accept far fewer tokens "
                "than this data can teach. %s.\n%s", "!" * 100, total, MIN_STEPS, advice, "!" * 100)


class Splits(NamedTuple):
    """The data of a run: what it trains on, and what it validates on."""

    train: Dataset
    val: Dataset


@dataclass(frozen=True)
class Run:
    """Where a run keeps its state and what it reports to."""

    folder: Path  # the run folder: checkpoints, resumed from (training.checkpoints.run_folder)
    seed: int  # the data order's seed
    live: Any = None  # a dvclive Live on the main process, None on the others


def fit(ttt: TrainingTimeTest, head: VerifierHead, splits: Splits, cfg: TrainConfig, run: Run,
        world: World) -> tuple[dict[str, Any], dict]:
    """Train until the last step (resuming from ``run.folder``); returns the run summary and the weights of its best
    validation (a model state dict).

    ``ttt`` and ``head`` are on ``world.device``.
    """
    run_dir, live = run.folder, run.live
    run_dir.mkdir(parents=True, exist_ok=True)
    batching = cfg.batching(world.size)
    check_lengths(splits._asdict(), batching)
    plan = DataPlan(splits.train.lengths, batching, run.seed, world.rank, world.size)
    total = cfg.max_steps or plan.steps(cfg.epochs)
    warmup = warmup_steps(cfg.warmup_fraction, total)
    if world.main:
        log.info("%d optimizer steps of %d tokens, %d of them warmup; per process and step: %d x %d packed rows of %d "
                 "tokens (micro-batches x rows), %d processes", total, cfg.batch_tokens, warmup, batching.grad_accum,
                 batching.batch_size, cfg.pack_tokens, world.size)
        warn_if_undertrained(total, cfg)
    compiled, spent = compiles(cfg, world), Spent()
    with spent.on("setting up the step"):
        if compiled:
            compile_step(ttt, head, graphs(cfg, world))
        model = parallel.wrap(ttt, world, cfg.fsdp)
        optimizers = make_optimizers(model, cfg, fused=world.device.type == "cuda")
        factor = partial(lr_factor, warmup=warmup, total=total, floor=cfg.min_lr_ratio)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in optimizers]
        state = resume(run_dir, model, optimizers, schedulers)
    with spent.on("placing the states"):
        train_set, val_set = on_device(splits._asdict(), cfg, world).values()
    if state.step:
        log.info("resumed %s at step %d", run_dir, state.step)
    replay(live, state)
    collate_fn = partial(collate_ttt, batching=batching, ttt_steps=cfg.ttt_steps, static=graphs(cfg, world))
    batches = iter(step_batches(train_set, plan, range(state.step, total), collate_fn, cfg.num_workers, world.device.type == "cuda"))
    val_batches = validation_batches(val_set, cfg, world)
    window, clock = torch.zeros(6, cfg.ttt_steps, device=world.device), Window()
    compiling = state.step if compiled else None  # the step whose call compiles the step's graphs
    while state.step < total:
        with spent.on("waiting for rows"):
            micro = [to_device(next(batches), world.device, train_set) for _ in range(batching.grad_accum)]
        with spent.on("the first step (compiling)" if state.step == compiling else "queueing steps"):
            sums, norm = train_step(model, head, micro, Optimisation(optimizers, schedulers), cfg, world)
        state.step += 1
        window += sums
        clock.add(sum(b["tokens"] for b in micro), norm)
        done = state.step == total
        if state.step % cfg.log_every == 0 or done:
            clock.close(state.step, window, schedulers[0].get_last_lr()[0])
            window.zero_()
        validating, saving = state.step % cfg.val_every == 0 or done, state.step % cfg.checkpoint_every == 0 or done
        if validating or saving or clock.full():  # the history is read in this order: train lines first
            with spent.on("logging"):
                for step, metrics in train_metrics(clock, cfg.step_decay, world):  # one host sync for the queued lines
                    record(live, state, "train", metrics, step)
        if validating:
            with spent.on("validating"):
                metrics = validate(model, head, val_batches, cfg, world)
            record(live, state, "val", metrics)
            if state.best is None or metrics["sim_accept_len"] > state.best["sim_accept_len"]:
                state.best = {**metrics, "step": state.step}
                with spent.on("keeping the best weights"):
                    state.best_weights = parallel.model_copy(model, world)
        if saving:
            with spent.on("checkpointing"):
                save_checkpoint(run_dir, model, optimizers, schedulers, state, world)
    if world.main:
        log.info("fit's wall time: %s", spent.summary())
        if compiled:
            log.info("torch.compile's largest timers (nested, workers summed; seconds): %s", largest_compile_timers())
            log.info("compiled graphs: %s", compile_cache_counts())
    last = next((metrics for _, prefix, metrics in reversed(state.history) if prefix == "train"), {})
    return {"steps": total, "train": last, "best": state.best}, state.best_weights
