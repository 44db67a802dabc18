"""Stage ``train``: the EAGLE-3 drafter, trained with training-time test, exported for SGLang/vLLM.

    python -m eagle3.train models/verifier data/merged data/hidden_states models/drafter \\
        --checkpoints .eagle3/checkpoints/train --live dvclive/train --device cpu --threads 2
    torchrun --nproc-per-node N --nnodes M ... -m eagle3.train (same arguments)   # DDP, or FSDP
    # params.yaml: seed, train, model.draft_head

The stage is its wiring: the data, the verifier's parts, the drafter and the run folder handed
to the library in ``eagle3.training``. Its loop, ``fit`` (``training.loop``), reads top to bottom:
``train_step`` (``training.step``: verifier targets, TTT forward, loss, backward, clip,
optimizer step) for every optimizer step; ``validate`` every ``val_every`` steps, keeping the
weights of the best validation simulated acceptance length; ``save_checkpoint`` every
``checkpoint_every`` steps into ``<checkpoints>/<run id>/`` (outside the DVC outputs). A killed
run started again with the same inputs resumes from its last checkpoint: weights, optimizer,
scheduler, step (which fixes the data position: the order is a function of seed and step), RNG
states and the metric history, which is replayed into dvclive so a resumed run's metrics and plots
are those of an uninterrupted one. The run id, its lock and the checkpoints are
``eagle3.training.checkpoints``; what is logged, ``eagle3.training.reporting``. A rerun over a
finished run trains nothing and re-exports the same bytes. At the end the best weights are
exported and checked (``training.checkpoints.export``, in the format of ``eagle3.drafter.export``).
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.train")

import argparse
import logging
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from eagle3.common import RUN_EXPORTED, UserError
from eagle3.hidden_states.loader import HiddenStates
from eagle3.lm.loading import verifier_fingerprint, verifier_parts
from eagle3.lm.spec import FINAL_STATES, ModelSettings, VerifierSpec, require_verifier
from eagle3.settings import StageParams, keys_of, require_device, section, stage_params
import eagle3.training.parallel as parallel
from eagle3.training.checkpoints import Trained, export, run_folder, run_id
from eagle3.training.config import TrainConfig
from eagle3.training.drafter import Verifier, make_drafter
from eagle3.training.data import DataPlan
from eagle3.training.loop import Run, Splits, fit
from eagle3.training.parallel import World
from eagle3.training.reporting import log_summary
from eagle3.training.step import compiles, start_compile_workers

log = logging.getLogger(__name__)

PARAMS = StageParams("seed", section(TrainConfig), keys_of(ModelSettings, "draft_head"))  # = dvc.yaml
CLOCK_METRICS = ("tokens_per_s",)  # logged to dvclive and the log, never written into models/drafter


# ---------------------------------------------------------------------------------------------
# Inputs and outputs


def open_data(merged: Path, hidden_states: Path, fingerprint: str) -> tuple[Dataset, Dataset, dict, Tensor]:
    from safetensors.torch import load_file

    train_set, val_set = HiddenStates(merged, hidden_states, "train"), HiddenStates(merged, hidden_states, "val")
    meta = train_set.meta
    require_verifier(f"{merged}/meta.json", "built for", meta["verifier"]["fingerprint"], fingerprint)
    if meta.get("final_state") not in FINAL_STATES:
        raise UserError(f"{merged}/meta.json: final_state {meta.get('final_state')!r} is not one of {list(FINAL_STATES)} "
                        "(train applies only the lm_head to `final`); re-run `dvc repro` (extract, merge)")
    return train_set, val_set, meta, load_file(merged / "vocab.safetensors")["d2t"]



@dataclass(frozen=True)
class TrainPaths:
    """The stage's files: its inputs and outputs in dvc.yaml, and the checkpoints kept outside them."""

    verifier: Path  # models/verifier
    merged: Path  # data/merged: the manifest of (shard, sample) references and the draft vocabulary
    hidden_states: Path  # data/hidden_states: the shards the manifest references
    out: Path  # models/drafter: the export
    checkpoints: Path  # resumable runs, one folder per run id (not a DVC output)
    live: Path  # the dvclive folder of metrics and plots


def train(paths: TrainPaths, cfg: TrainConfig, seed: int, draft_head: dict[str, Any], world: World) -> dict[str, Any]:
    """The whole stage on one process of the world; ``draft_head``: params ``model.draft_head``."""
    if compiles(cfg, world):
        start_compile_workers()
    fingerprint = verifier_fingerprint(paths.verifier)
    train_set, val_set, meta, d2t = open_data(paths.merged, paths.hidden_states, fingerprint)
    config, tensors = verifier_parts(paths.verifier)
    torch.manual_seed(seed)  # the same initial weights on every process
    ttt, head = make_drafter(Verifier(config, tensors, d2t, meta["aux_layers"]), draft_head, cfg, world)
    draft = ttt.drafter.config
    shards = sorted({row["shard"] for row in train_set.rows + val_set.rows})
    make_id = partial(run_id, asdict(cfg), draft.to_dict(), fingerprint=fingerprint, seed=seed, processes=world.size)
    with run_folder(paths.checkpoints, paths.merged, paths.hidden_states, shards, make_id, world) as run_dir:
        live = None
        if world.main:
            from dvclive import Live

            live = Live(str(paths.live), dvcyaml=False, save_dvc_exp=False)  # a fresh record; fit replays a resumed history
        summary, best_weights = fit(ttt, head, Splits(train_set, val_set), cfg, Run(run_dir, seed, live), world)
        if world.main:
            training = {**summary, "train": {k: v for k, v in summary["train"].items() if k not in CLOCK_METRICS},
                        "run": run_dir.name, "processes": world.size, "params": asdict(cfg),
                        "data": {"merged": str(paths.merged), "train_samples": len(train_set), "val_samples": len(val_set)}}
            export(paths.out, paths.verifier, Trained(best_weights, draft, tensors["embed"], d2t), training)
            (run_dir / RUN_EXPORTED).write_text(f"{paths.out}\n")
            tokens = DataPlan(train_set.lengths, cfg.batching(world.size), seed, processes=world.size).tokens(summary["steps"])
            log_summary(live, summary, tokens)
    parallel.barrier(world)
    return summary


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.train", description="train and export the EAGLE-3 drafter")
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("merged", type=Path, help="training mixture, e.g. data/merged")
    parser.add_argument("hidden_states", type=Path, help="extracted shards, e.g. data/hidden_states")
    parser.add_argument("out", type=Path, help="export folder, e.g. models/drafter")
    parser.add_argument("--checkpoints", type=Path, required=True, help="resumable checkpoints, outside DVC outputs")
    parser.add_argument("--live", type=Path, required=True, help="dvclive folder for metrics and plots")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads per process (0: torch's default)")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    params = stage_params(PARAMS, args.params)  # before anything starts
    require_device("layout.device", args.device)  # dvc.yaml hands the layout's device as an argument
    cfg, seed = TrainConfig.from_params(params.train), int(params.seed)
    draft_head = VerifierSpec.from_params(params.model).draft_head
    paths = TrainPaths(verifier=args.verifier, merged=args.merged, hidden_states=args.hidden_states, out=args.out,
                       checkpoints=args.checkpoints, live=args.live)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = parallel.init_world(args.device)
    try:
        train(paths, cfg, seed, draft_head, world)
    finally:
        parallel.close_world(world)
