"""What a training run reports: the log line and dvclive's metrics and plots of every logged step,
kept in the checkpointed history so a resumed run replays them, and the summary at its end.

    window, clock = torch.zeros(6, K), Window()        # metric sums and tokens/time since the last line
    clock.add(tokens, grad_norm)                       # every optimizer step
    clock.close(step, window, lr)                      # every train.log_every steps: a line, still on the device
    for step, metrics in train_metrics(clock, step_decay, world):   # now and then: the queued lines, one host sync
        record(live, state, "train", metrics, step)
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

import eagle3.training.parallel as parallel
from eagle3.training.checkpoints import TrainState
from eagle3.training.loss import StepMetrics
from eagle3.training.parallel import World

log = logging.getLogger(__name__)


# Train lines wait on the device for at most this many optimizer steps. Why: turning a line into
# numbers waits for the GPU to finish every step queued before it, and the host cannot prepare the
# next steps meanwhile: at one line a step (train.log_every 1) the GPU idled between steps.
SYNC_EVERY = 50


class Window:
    """Gradient norms since the last line, tokens since the last sync, and the lines not yet turned into numbers.

    A line keeps its step, metric sums, mean gradient norm and lr, the tensors still on the
    device; ``train_metrics`` turns all queued lines into numbers at once (one host sync), at
    least every ``SYNC_EVERY`` steps and before anything reads the history (validation, checkpoint,
    the end). The numbers are those of one line a host sync, except tokens_per_s: a clock value,
    the rate over all steps since the previous sync.
    """

    def __init__(self):
        self.norms, self.lines = [], []  # the open line's gradient norms; the closed lines
        self.restart()

    def restart(self) -> None:
        """Start the clock of the next sync: its tokens (all processes' are summed then) and steps."""
        self.synced_tokens, self.steps, self.start = 0, 0, time.perf_counter()

    def add(self, tokens: int, norm: Tensor) -> None:
        self.synced_tokens += tokens
        self.steps += 1
        self.norms.append(norm.detach())

    def close(self, step: int, sums: Tensor, lr: float) -> None:
        """End the current line at optimizer step ``step``: metric sums [6, K] of its steps (copied), lr."""
        norm = torch.stack(self.norms).mean() if self.norms else torch.zeros((), device=sums.device)
        self.lines.append((step, sums.clone(), norm, lr))
        self.norms = []

    def full(self) -> bool:
        return self.steps >= SYNC_EVERY


def train_metrics(clock: Window, step_decay: float, world: World) -> list[tuple[int, dict[str, float]]]:
    """The queued lines' metrics (each over the steps of its line and all processes) with their steps;
    logged by the main process. Empties the queue and restarts the clock."""
    if not clock.lines:
        return []
    steps, sums, norms, lrs = zip(*clock.lines)
    sums = parallel.all_reduce_sum(torch.stack(sums), world).cpu()  # [lines, 6, K]: the host sync
    tokens = parallel.all_reduce_sum(torch.tensor([float(clock.synced_tokens)], device=world.device), world)
    tokens_per_s = float(tokens) / max(time.perf_counter() - clock.start, 1e-9)
    norms = torch.stack(norms).cpu()
    out = []
    for step, line, norm, lr in zip(steps, sums, norms, lrs):
        metrics = StepMetrics(line).summary(step_decay)
        metrics.update(lr=lr, tokens_per_s=tokens_per_s, grad_norm=float(norm))
        if world.main:
            log.info("step %d loss %.4f acc_0 %.3f sim_accept_len %.3f lr %.2e %.0f tok/s", step, metrics["loss"],
                     metrics["acc_0"], metrics["sim_accept_len"], lr, tokens_per_s)
        out.append((step, metrics))
    clock.lines = []
    clock.restart()
    return out


def record(live, state: TrainState, prefix: str, metrics: dict[str, float], step: int | None = None) -> None:
    """Log ``metrics`` at ``step`` (default: the current step) and keep them in the state (checkpointed,
    replayed on resume)."""
    step = state.step if step is None else step
    state.history.append((step, prefix, metrics))
    log_metrics(live, step, prefix, metrics)


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
