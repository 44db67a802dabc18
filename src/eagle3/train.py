"""Stage ``train``: the EAGLE-3 drafter, trained with training-time test, exported for SGLang/vLLM.

    python -m eagle3.train models/verifier data/merged data/hidden_states models/drafter \\
        --checkpoints .eagle3/checkpoints/train --live dvclive/train --device cpu --threads 2
    torchrun --nproc-per-node N --nnodes M ... -m eagle3.train (same arguments)   # DDP, or FSDP
    # params.yaml: seed, train, model.draft_head

``fit`` reads top to bottom: ``train_step`` (verifier targets, TTT forward, loss, backward, clip,
optimizer step) for every optimizer step; ``validate`` every ``val_every`` steps, keeping the
weights of the best validation simulated acceptance length; ``save_checkpoint`` every
``checkpoint_every`` steps into ``<checkpoints>/<run id>/`` (outside the DVC outputs). A killed
run started again with the same inputs resumes from its last checkpoint: weights, optimizer,
scheduler, step (which fixes the data position: the order is a function of seed and step), RNG
states and the metric history, which is replayed into dvclive so a resumed run's metrics and plots
are those of an uninterrupted one. The run id, its lock and the checkpoints are
``eagle3.drafter.checkpoints``; what is logged, ``eagle3.drafter.reporting``. A rerun over a
finished run trains nothing and re-exports the same bytes. At the end the best weights are
exported and checked (``eagle3.drafter.export``).
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from eagle3.common import UserError, atomic_dir, stage_main, to_plain
from eagle3.config import batch_share_problem, refuse, stage_params
import eagle3.drafter.parallel as parallel
from eagle3.drafter.checkpoints import resume, run_folder, run_id, save_best, save_checkpoint
from eagle3.drafter.export import check_drafter, verifier_facts, write_drafter
from eagle3.drafter.loss import StepMetrics, TrainingTimeTest, VerifierHead, select_rows, step_counts, ttt_loss
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.drafter.parallel import World
from eagle3.drafter.reporting import Window, log_summary, record, replay, train_metrics
from eagle3.hidden_states.loader import Batching, DataPlan, HiddenStates, InOrder, check_lengths, collate, step_batches
from eagle3.lm.loading import verifier_fingerprint, verifier_parts
from eagle3.lm.spec import FINAL_STATES, VerifierSpec, require_verifier

log = logging.getLogger(__name__)

PARAMS = ("seed", "train", "model.draft_head")  # = dvc.yaml
CLOCK_METRICS = ("tokens_per_s",)  # logged to dvclive and the log, never written into models/drafter


@dataclass(frozen=True)
class TrainConfig:
    """The ``train`` params section. Values come only from params.yaml (conf/train/*.yaml): no
    field has a default, so a key missing there is an error, never a silent second value."""

    ttt_steps: int  # K: draft steps unrolled in training
    step_decay: float  # loss weight of TTT step k is step_decay**k
    loss_normalisation: str  # token: step k's loss is the mean over valid targets; sequence: over documents
    optimizer: str  # adamw; or muon: Muon on the hidden matrices, AdamW on the rest
    lr: float  # peak learning rate (Muon's scaled to AdamW's update size)
    min_lr_ratio: float  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_fraction: float  # share of the optimizer steps spent in linear warmup
    weight_decay: float  # decoupled weight decay (AdamW's and Muon's)
    epochs: int  # passes over the train split (when max_steps is 0)
    max_steps: int  # optimizer steps to run; 0: from epochs
    batch_tokens: int  # global batch: packed-row tokens per optimizer step, over all processes
    micro_batch_rows: int  # at most this many packed rows per forward, per process (what the GPU holds)
    pack_tokens: int  # tokens per packed row; at least the longest sample
    lm_head_init: str  # random, or verifier: its lm_head rows of the draft vocabulary (and final norm)
    freeze_lm_head: bool  # keep the lm_head at its verifier start
    clip: float  # max global gradient norm
    log_every: int  # optimizer steps between train metric lines (their numbers reach the host in batches: reporting.Window)
    val_every: int  # optimizer steps between validations (and at the end)
    checkpoint_every: int  # optimizer steps between resumable checkpoints (and at the end)
    fsdp: bool  # FSDP instead of DDP (multi-process only)
    num_workers: int  # DataLoader worker processes per training process
    compile: bool | str  # auto: the TTT forward and the verifier head compiled on CUDA (not with fsdp); true, false

    def compiles(self, world: World) -> bool:
        """Whether ``train.compile`` compiles the step on this process's device."""
        if self.compile == "auto":
            return world.device.type == "cuda" and not self.fsdp
        return bool(self.compile)

    @classmethod
    def from_params(cls, section) -> TrainConfig:
        values = {k: v for k, v in to_plain(section).items() if k != "name"}
        known = {f.name for f in fields(cls)}
        if set(values) - known:
            raise UserError(f"params.yaml: train: unknown key(s) {sorted(set(values) - known)}; known: {sorted(known)}")
        if known - set(values):
            raise UserError(f"params.yaml: train: missing key(s) {sorted(known - set(values))}; see conf/train/default.yaml")
        return cls(**values)  # values validated by config.validate

    def batching(self, processes: int) -> Batching:
        """The recipe's global batch on ``processes`` processes: its ``batch_tokens // pack_tokens``
        rows split evenly over the processes, each process's share in micro-batches of the largest
        row count that divides it and fits ``micro_batch_rows``, accumulated. The global batch, and
        so the training, is the same on one GPU or eight; the layout changes only how it is cut.

        Worked example: batch_tokens 16384, pack_tokens 2048 -> 8 rows a step; 2 processes with
        micro_batch_rows 3 -> 4 rows each, in 2 micro-batches of 2 rows (grad_accum 2).
        """
        problem = batch_share_problem(self.batch_tokens, self.pack_tokens, processes, "the processes torchrun started")
        if problem:
            raise refuse("train.batch_tokens", self.batch_tokens, problem)
        share = self.batch_tokens // self.pack_tokens // processes  # config.validate: a whole number of rows
        micro = max(d for d in range(1, min(share, self.micro_batch_rows) + 1) if share % d == 0)
        return Batching(self.pack_tokens, micro, share // micro)

    def val_batching(self) -> Batching:
        """Validation's cut: ``micro_batch_rows`` rows a forward, nothing to accumulate."""
        return Batching(self.pack_tokens, self.micro_batch_rows, 1)


# ---------------------------------------------------------------------------------------------
# Batches: the data order is hidden_states.loader's DataPlan; here the TTT selection is added


def collate_ttt(items: list[dict[str, Tensor]], batching: Batching, ttt_steps: int) -> dict[str, Any]:
    """``eagle3.hidden_states.loader.collate`` into the packed rows of a micro-batch, plus the rows each
    of the ``ttt_steps`` TTT steps scores and the count of real tokens (host side)."""
    batch = collate(items, batching)
    return {"input_ids": batch["input_ids"], "aux": batch["aux"], "final": batch["final"], "position_ids": batch["position_ids"],
            "selection": select_rows(batch["loss_mask"], batch["position_ids"], ttt_steps), "tokens": batch["tokens"]}


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The micro-batch on ``device`` (asynchronous from pinned memory). The selection's sizes (targets, rows
    each TTT step scores) differ from batch to batch: they are marked dynamic for torch.compile (nothing
    else reads the mark), so a compiled step compiles once, not once static and then again dynamic."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, Tensor)}
    if device.type == "cpu":  # the CPU computes in float32: bf16-stored states widened, exactly (a GPU's autocast casts)
        moved.update({k: moved[k].float() for k in ("aux", "final")})
    selection = batch["selection"].to(device, non_blocking=True)
    for tensor in selection.tensors():
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return {**batch, **moved, "selection": selection}


def compile_step(ttt: TrainingTimeTest, head: VerifierHead) -> None:
    """``train.compile``: the TTT unroll (forward and, through autograd, backward: loss, metrics, attention,
    the soft cross-entropy over the draft vocabulary) and the verifier head compiled into generated
    kernels, in place (state dicts keep their names). Why: eager, each op of the unroll is a kernel
    launched from Python, and at the 10k recipe's shape the host, not the GPU, set the pace (one H200
    read 2-13 % busy). The optimizer (fused AdamW) and the clipping stay eager: a few multi-tensor
    kernels each."""
    ttt.compile()
    head.compile()


# ---------------------------------------------------------------------------------------------
# Optimisation


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based): linear warmup, cosine decay.

    Worked example (warmup 2, total 6, floor 0.1): steps 0, 1 -> 0.5, 1.0; then the cosine runs
    from 1.0 at step 2 to 0.1 at step 6 (step 4 -> 0.55).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(fraction: float, total: int) -> int:
    """Warmup steps of a run of ``total`` steps: ``fraction`` of them, at least one unless fraction is 0."""
    return max(1, round(fraction * total)) if fraction > 0 else 0


# Fewer optimizer steps than this leave a drafter far below what its data can teach (1k prompts,
# the same tokens: 54 steps held-out chain τ 1.36, 218 steps 2.02, 644 steps 2.37 on one H200).
MIN_STEPS = 500


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


def make_optimizers(model: torch.nn.Module, cfg: TrainConfig, fused: bool) -> list[torch.optim.Optimizer]:
    """``train.optimizer``'s optimizers over the trained parameters: AdamW alone, or (muon) Muon on the
    hidden matrices (fc and the layer's projections) beside AdamW on the rest (norms, the lm_head:
    an output head is no hidden transform to orthogonalise). Muon's update is scaled to AdamW's RMS
    (``match_rms_adamw``), so one ``lr`` means the same step size in both."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            hidden_matrix = cfg.optimizer == "muon" and p.ndim == 2 and not name.endswith("lm_head.weight")
            (matrices if hidden_matrix else rest).append(p)
    adamw = torch.optim.AdamW(rest, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=fused)
    if not matrices:
        return [adamw]
    return [torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"), adamw]


def train_step(model, head: VerifierHead, micro: list[dict], optimizers: list, schedulers: list, cfg: TrainConfig,
               world: World) -> tuple[Tensor, Tensor]:
    """One optimizer step over this process's micro-batches; returns (metric sums [6, K], grad norm).

    The loss is normalised by the counts (valid targets, or documents: ``cfg.loss_normalisation``)
    of the *global* batch (all-reduced before any backward), and multiplied by the world size
    because DDP/FSDP average gradients: the gradient equals that of one process holding the whole
    global batch.
    """
    targets = [head(b["final"], b["selection"].positions) for b in micro]  # no grad, once per batch
    counts = sum(step_counts(t, b["selection"], cfg.loss_normalisation) for t, b in zip(targets, micro))
    counts = parallel.all_reduce_sum(counts, world)
    sums = 0
    for i, (batch, target) in enumerate(zip(micro, targets)):
        with parallel.gradient_sync(model, enabled=i == len(micro) - 1), parallel.autocast(world.device):
            ce, step_sums = model(batch["input_ids"], batch["aux"], batch["position_ids"], target, batch["selection"])
            loss = ttt_loss(ce, counts, cfg.step_decay) * world.size
        loss.backward()
        sums = sums + step_sums
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    for optimizer, scheduler in zip(optimizers, schedulers):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return sums, norm


@torch.no_grad()
def validate(model, head: VerifierHead, dataset: Dataset, cfg: TrainConfig, world: World) -> dict[str, float]:
    """Metrics over the whole validation split (every process runs the same number of batches)."""
    net = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    plan = InOrder(dataset.lengths, cfg.val_batching(), world.rank, world.size)
    total = torch.zeros(6, cfg.ttt_steps, device=world.device)
    for step in range(plan.steps(1)):
        indices = sum(plan.micro_batches(step), [])  # none on a process the last step leaves without rows
        batch = to_device(collate_ttt([dataset[i] for i in indices or [0]], plan.batching, cfg.ttt_steps), world.device)
        with parallel.autocast(world.device):
            target = head(batch["final"], batch["selection"].positions)
            _, sums = net(batch["input_ids"], batch["aux"], batch["position_ids"], target, batch["selection"])
        total += sums if indices else 0  # an idle process still joins FSDP's collectives
    return StepMetrics(parallel.all_reduce_sum(total, world)).summary(cfg.step_decay)


# ---------------------------------------------------------------------------------------------
# The loop


def fit(ttt: TrainingTimeTest, head: VerifierHead, train_set: Dataset, val_set: Dataset, cfg: TrainConfig, seed: int,
        run_dir: Path, world: World, live=None) -> dict[str, Any]:
    """Train until the last step (resuming from ``run_dir``); returns the run summary.

    ``ttt`` and ``head`` are on ``world.device``; ``live`` (main process only) is a dvclive Live.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    batching = cfg.batching(world.size)
    check_lengths({"train": train_set, "val": val_set}, batching)
    plan = DataPlan(train_set.lengths, batching, seed, world.rank, world.size)
    total = cfg.max_steps or plan.steps(cfg.epochs)
    warmup = warmup_steps(cfg.warmup_fraction, total)
    if world.main:
        log.info("%d optimizer steps of %d tokens, %d of them warmup; per process and step: %d x %d packed rows of %d "
                 "tokens (micro-batches x rows), %d processes", total, cfg.batch_tokens, warmup, batching.grad_accum,
                 batching.batch_size, cfg.pack_tokens, world.size)
        warn_if_undertrained(total, cfg)
    if cfg.compiles(world):
        compile_step(ttt, head)
    model = parallel.wrap(ttt, world, cfg.fsdp)
    optimizers = make_optimizers(model, cfg, fused=world.device.type == "cuda")
    factor = partial(lr_factor, warmup=warmup, total=total, floor=cfg.min_lr_ratio)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in optimizers]
    state = resume(run_dir, model, optimizers, schedulers, world)
    if state.step:
        log.info("resumed %s at step %d", run_dir, state.step)
    replay(live, state)
    collate_fn = partial(collate_ttt, batching=batching, ttt_steps=cfg.ttt_steps)
    batches = iter(step_batches(train_set, plan, state.step, total, collate_fn, cfg.num_workers, world.device.type == "cuda"))
    window, clock = torch.zeros(6, cfg.ttt_steps, device=world.device), Window()
    while state.step < total:
        micro = [to_device(next(batches), world.device) for _ in range(batching.grad_accum)]
        sums, norm = train_step(model, head, micro, optimizers, schedulers, cfg, world)
        state.step += 1
        window += sums
        clock.add(sum(b["tokens"] for b in micro), norm)
        done = state.step == total
        if state.step % cfg.log_every == 0 or done:
            clock.close(state.step, window, schedulers[0].get_last_lr()[0])
            window.zero_()
        validating, saving = state.step % cfg.val_every == 0 or done, state.step % cfg.checkpoint_every == 0 or done
        if validating or saving or clock.full():  # the history is read in this order: train lines first
            for step, metrics in train_metrics(clock, cfg.step_decay, world):  # one host sync for the queued lines
                record(live, state, "train", metrics, step)
        if validating:
            metrics = validate(model, head, val_set, cfg, world)
            record(live, state, "val", metrics)
            if state.best is None or metrics["sim_accept_len"] > state.best["sim_accept_len"]:
                state.best = {**metrics, "step": state.step}
                save_best(run_dir, model, state, world)
        if saving:
            save_checkpoint(run_dir, model, optimizers, schedulers, state, world)
    last = next((metrics for _, prefix, metrics in reversed(state.history) if prefix == "train"), {})
    return {"steps": total, "train": last, "best": state.best}


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


def export(out: Path, verifier: Path, state: dict[str, Tensor], draft: DraftConfig, embed: Tensor, d2t: Tensor, training: dict) -> None:
    """Write the drafter of ``state`` (TTT module names) to ``out`` and refuse it unless check_drafter passes."""
    drafter = Eagle3Drafter(draft, embed.cpu())
    drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in state.items()})
    if not torch.equal(drafter.d2t, d2t):
        raise RuntimeError("the trained drafter's d2t differs from data/merged's")
    with atomic_dir(out) as tmp:
        write_drafter(drafter, tmp, verifier_facts(verifier), training)
        problems = check_drafter(tmp, verifier)
        if problems:
            raise UserError(f"{out}: the export fails check-drafter: {'; '.join(problems)}")
    log.info("drafter exported to %s", out)


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
    fingerprint = verifier_fingerprint(paths.verifier)
    train_set, val_set, meta, d2t = open_data(paths.merged, paths.hidden_states, fingerprint)
    config, tensors = verifier_parts(paths.verifier)
    try:
        draft = DraftConfig.from_verifier(config, len(d2t), meta["aux_layers"], draft_head)
    except ValueError as err:
        raise UserError(f"params.yaml: model.draft_head: {err}") from None
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    torch.manual_seed(seed)  # the same initial weights on every process
    drafter = Eagle3Drafter(draft, tensors["embed"].to(world.device, dtype)).to(world.device)
    drafter.set_draft_vocab(d2t.to(world.device))
    if cfg.lm_head_init == "verifier":
        drafter.init_head(tensors["head"].to(world.device), tensors["norm"].to(world.device))
    drafter.lm_head.requires_grad_(not cfg.freeze_lm_head)  # frozen: no gradient, no optimizer state
    head = VerifierHead(tensors["head"].to(world.device, dtype), d2t.to(world.device)).to(world.device)
    shards = sorted({row["shard"] for row in train_set.rows + val_set.rows})
    make_id = partial(run_id, asdict(cfg), draft.to_dict(), fingerprint=fingerprint, seed=seed, processes=world.size)
    with run_folder(paths.checkpoints, paths.merged, paths.hidden_states, shards, make_id, world) as run_dir:
        live = None
        if world.main:
            from dvclive import Live

            live = Live(str(paths.live), dvcyaml=False, save_dvc_exp=False)  # a fresh record; fit replays a resumed history
        ttt = TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation)
        summary = fit(ttt, head, train_set, val_set, cfg, seed, run_dir, world, live)
        if world.main:
            best = torch.load(run_dir / "best.pt", map_location="cpu", weights_only=False)
            training = {**summary, "train": {k: v for k, v in summary["train"].items() if k not in CLOCK_METRICS},
                        "run": run_dir.name, "processes": world.size, "params": asdict(cfg),
                        "data": {"merged": str(paths.merged), "train_samples": len(train_set), "val_samples": len(val_set)}}
            export(paths.out, paths.verifier, best["model"], draft, tensors["embed"], d2t, training)
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
    cfg, seed = TrainConfig.from_params(params.train), int(params.seed)
    draft_head = VerifierSpec.from_params(params.model).draft_head
    paths = TrainPaths(args.verifier, args.merged, args.hidden_states, args.out, args.checkpoints, args.live)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = parallel.init_world(args.device)
    try:
        train(paths, cfg, seed, draft_head, world)
    finally:
        parallel.close_world(world)


if __name__ == "__main__":
    stage_main(main)
