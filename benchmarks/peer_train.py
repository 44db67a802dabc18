"""The peer's own trainer (``speculators train``, 0.9.0) run exactly as its CLI runs it, observed:
its optimizer steps, the real tokens it trained on and when each step ended go to a JSON file.

    python benchmarks/peer_train.py --record peer.json -- --verifier-name-or-path models/verifier \\
        --data-path peer-data --save-path checkpoints ...     # everything after -- is its own flags

Why a wrapper: ``peer_tau.py`` compares equal tokens and equal time, which needs its step count,
tokens and steady step time; its logs give them only as progress lines. Nothing of its training
changes on a machine with an accelerator. Without one (our CPU checks) its ``Trainer`` cannot run
as it is (it moves the model to device index 0 and synchronizes the accelerator to time each
step), so there the device becomes "cpu" and the synchronization a no-op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def observe(trainer_class, record: dict) -> None:
    """Count each training forward's real tokens (``document_ids != -1``, its padding marker) and
    stamp the end of each optimizer step. Both read what its loop already has; the count's host sync
    adds nothing at its default ``log_freq`` 1, whose step timer synchronizes every step anyway."""
    setup_model, optimizers_step = trainer_class.setup_model, trainer_class._optimizers_step

    def count(module, args, kwargs):
        if module.training:
            record["tokens"] += int((kwargs["document_ids"] != -1).sum())

    def setup_counting(self):
        setup_model(self)
        self.model.register_forward_pre_hook(count, with_kwargs=True)

    def step_stamped(self):
        optimizers_step(self)
        record["step_ends"].append(time.perf_counter())

    trainer_class.setup_model, trainer_class._optimizers_step = setup_counting, step_stamped


def on_cpu(trainer_module) -> None:
    """Let its Trainer run without an accelerator: device "cpu" for index 0, no device synchronization."""
    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, required=True, help="JSON file for steps, tokens and step times")
    parser.add_argument("peer_args", nargs=argparse.REMAINDER, help="-- then speculators train's own flags")
    args = parser.parse_args()
    argv = args.peer_args[1:] if args.peer_args[:1] == ["--"] else args.peer_args
    import speculators.train.trainer as trainer_module
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    if not torch.accelerator.is_available():
        on_cpu(trainer_module)
    record = {"argv": argv, "tokens": 0, "step_ends": []}
    observe(trainer_module.Trainer, record)
    start = time.perf_counter()
    try:
        train(TrainConfig.resolve(argv))
    finally:
        ends = [t - start for t in record.pop("step_ends")]
        record.update(steps=len(ends), seconds=round(time.perf_counter() - start, 2),
                      first_step_end=round(ends[0], 2) if ends else None,
                      step_seconds=round((ends[-1] - ends[0]) / (len(ends) - 1), 4) if len(ends) > 1 else None,
                      step_median_seconds=round(statistics.median(b - a for a, b in zip(ends, ends[1:])), 4) if len(ends) > 1 else None)
        args.record.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
