"""What a training run reports: the log line and dvclive's metrics and plots of every logged step,
kept in the checkpointed history so a resumed run replays them, and the summary at its end.

    window, clock = torch.zeros(6, K), Window()        # metric sums and tokens/time since the last line
    record(live, state, "train", train_metrics(step, window, clock, lr, step_decay, world))
    replay(live, state)                                # after a resume: the history into a fresh record
    log_summary(live, summary, tokens)                 # best/..., tokens_trained, the ttt_acceptance plot

``live`` is a dvclive ``Live`` on the main process and None on the others (they log nothing).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor

import eagle3.drafter.parallel as parallel
from eagle3.drafter.checkpoints import TrainState
from eagle3.drafter.loss import StepMetrics
from eagle3.drafter.parallel import World

log = logging.getLogger(__name__)


class Window:
    """Tokens, time and gradient norms since the last log line."""

    def __init__(self):
        self.tokens, self.start, self.norms = 0, time.perf_counter(), []

    def add(self, tokens: int, norm: Tensor) -> None:
        self.tokens += tokens
        self.norms.append(norm.detach())

    def take(self, world: World) -> tuple[float, float]:
        """(tokens/s over all processes, mean grad norm); resets the window."""
        tokens = parallel.all_reduce_sum(torch.tensor([float(self.tokens)], device=world.device), world)
        rate = float(tokens) / max(time.perf_counter() - self.start, 1e-9)
        norm = float(torch.stack(self.norms).mean()) if self.norms else 0.0
        self.__init__()
        return rate, norm


def train_metrics(step: int, window: Tensor, clock: Window, lr: float, step_decay: float, world: World) -> dict[str, float]:
    """The metrics of the steps since the last log line, over all processes, logged by the main process."""
    metrics = StepMetrics(parallel.all_reduce_sum(window.clone(), world)).summary(step_decay)
    tokens_per_s, grad_norm = clock.take(world)
    metrics.update(lr=lr, tokens_per_s=tokens_per_s, grad_norm=grad_norm)
    if world.main:
        log.info("step %d loss %.4f acc_0 %.3f sim_accept_len %.3f lr %.2e %.0f tok/s", step, metrics["loss"],
                 metrics["acc_0"], metrics["sim_accept_len"], lr, tokens_per_s)
    return metrics


def record(live, state: TrainState, prefix: str, metrics: dict[str, float]) -> None:
    """Log ``metrics`` at the current step and keep them in the state (checkpointed, replayed on resume)."""
    state.history.append((state.step, prefix, metrics))
    log_metrics(live, state.step, prefix, metrics)


def replay(live, state: TrainState) -> None:
    """Log a resumed run's history again, so its dvclive record is that of an uninterrupted run."""
    for step, prefix, metrics in state.history:
        log_metrics(live, step, prefix, metrics)


def log_metrics(live, step: int, prefix: str, metrics: dict[str, float]) -> None:
    if live is None:
        return
    live.step = step
    for name, value in metrics.items():
        live.log_metric(f"{prefix}/{name}", value)


def log_summary(live, summary: dict[str, Any], tokens: int) -> None:
    """The best validation's metrics, the tokens trained, and the best step's per-position accuracy
    (``plots/custom/ttt_acceptance.json``: one row per draft position, 1-based as in evaluate)."""
    best = summary["best"] or {}
    for name, value in best.items():
        live.log_metric(f"best/{name}", value, plot=False)
    live.log_metric("tokens_trained", tokens, plot=False)
    positions = sorted(int(name.removeprefix("acc_")) for name in best if name.startswith("acc_"))
    rows = [{"position": k + 1, "accuracy": best[f"acc_{k}"], "conditional": best[f"cond_acc_{k}"]} for k in positions]
    live.log_plot("ttt_acceptance", rows, x="position", y="accuracy")  # rendering is declared in dvc.yaml
    live.end()
