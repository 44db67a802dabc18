"""Stage ``train``: the EAGLE-3 drafter, trained with training-time test, exported for SGLang/vLLM.

    python -m eagle3.train models/verifier data/merged data/hidden_states models/drafter \\
        --checkpoints .eagle3/checkpoints/train --live dvclive/train --device cpu --threads 2
    torchrun --nproc-per-node N --nnodes M ... -m eagle3.train (same arguments)   # DDP, or FSDP
    # params.yaml: seed, train, model.draft_head

``fit`` reads top to bottom: ``train_step`` (verifier targets, TTT forward, loss, backward, clip,
optimizer step) for every optimizer step; ``validate`` every ``val_every`` steps, keeping the
weights of the best validation simulated acceptance length; ``save_checkpoint`` every
``checkpoint_every`` steps into ``<checkpoints>/<run hash>/`` (outside the DVC outputs). A killed
run started again with the same inputs resumes from its last checkpoint: weights, optimizer,
scheduler, step (which fixes the data position: the order is a function of seed and step), RNG
states and the metric history, which is replayed into dvclive so a resumed run's metrics and plots
are those of an uninterrupted one. The run hash covers every input of training (params, code, the
merged mixture and the bytes of every hidden-state file it references), and a lock on its folder
keeps a second trainer out. A rerun over a finished run trains nothing and re-exports the same
bytes. At the end the best weights are exported and checked (``eagle3.drafter.export``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from tqdm import tqdm

from eagle3.common import UserError, atomic_dir, sha256_file, stable_hash, stage_main, to_plain, write_json
from eagle3.config import stage_params
import eagle3.drafter.parallel as parallel
from eagle3.drafter.export import check_drafter, verifier_facts, write_drafter
from eagle3.drafter.loss import StepMetrics, TrainingTimeTest, VerifierHead, select_rows, step_counts, ttt_loss
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.drafter.parallel import World
from eagle3.hidden_states.loader import (Batching, DataPlan, HiddenStates, check_lengths, check_recorded_digests, collate, pack,
                                         step_batches)
from eagle3.verifiers.spec import VERIFIER_TENSORS, VerifierSpec, require_verifier

log = logging.getLogger(__name__)

PARAMS = ("seed", "train", "model.draft_head")  # = dvc.yaml

# What changes the weights, relative to the eagle3 package
TRAINING_CODE = ("train.py", "drafter/loss.py", "drafter/model.py", "drafter/parallel.py", "hidden_states/loader.py",
                 "hidden_states/storage.py", "verifiers/spec.py")
CLOCK_METRICS = ("tokens_per_s",)  # logged to dvclive and the log, never written into models/drafter


@dataclass(frozen=True)
class TrainConfig:
    """The ``train`` params section. Values come only from params.yaml (conf/train/*.yaml): no
    field has a default, so a key missing there is an error, never a silent second value."""

    ttt_steps: int  # K: draft steps unrolled in training
    step_decay: float  # loss weight of TTT step k is step_decay**k
    lr: float  # peak AdamW learning rate
    min_lr_ratio: float  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_fraction: float  # share of the optimizer steps spent in linear warmup
    weight_decay: float  # AdamW decoupled weight decay
    epochs: int  # passes over the train split (when max_steps is 0)
    max_steps: int  # optimizer steps to run; 0: from epochs
    batch_tokens: int  # global batch: packed-row tokens per optimizer step, over all processes
    micro_batch_rows: int  # at most this many packed rows per forward, per process (what the GPU holds)
    pack_tokens: int  # tokens per packed row; at least the longest sample
    lm_head_init: str  # random, or verifier: its lm_head rows of the draft vocabulary (and final norm)
    freeze_lm_head: bool  # keep the lm_head at its verifier start
    clip: float  # max global gradient norm
    log_every: int  # optimizer steps between train metric lines (the only host syncs)
    val_every: int  # optimizer steps between validations (and at the end)
    checkpoint_every: int  # optimizer steps between resumable checkpoints (and at the end)
    fsdp: bool  # FSDP instead of DDP (multi-process only)
    num_workers: int  # DataLoader worker processes per training process

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
        rows = self.batch_tokens // self.pack_tokens  # config.validate: a whole number of rows
        if rows % processes:
            raise UserError(f"params.yaml: train.batch_tokens {self.batch_tokens} makes {rows} rows of train.pack_tokens "
                            f"{self.pack_tokens} a step, which {processes} training processes cannot share evenly; "
                            f"use a multiple of {processes * self.pack_tokens}")
        share = rows // processes
        micro = max(d for d in range(1, min(share, self.micro_batch_rows) + 1) if share % d == 0)
        return Batching(self.pack_tokens, micro, share // micro)


# ---------------------------------------------------------------------------------------------
# Batches: the data order is hidden_states.loader's DataPlan; here the TTT selection is added


def collate_ttt(items: list[dict[str, Tensor]], cfg: TrainConfig, rows: int) -> dict[str, Any]:
    """``eagle3.hidden_states.loader.collate`` into ``rows`` packed rows, plus the rows each TTT step scores
    and the count of real tokens (host side)."""
    batch = collate(items, cfg.pack_tokens, rows)
    return {"input_ids": batch["input_ids"], "aux": batch["aux"], "final": batch["final"], "position_ids": batch["position_ids"],
            "selection": select_rows(batch["loss_mask"], batch["position_ids"], cfg.ttt_steps), "tokens": batch["tokens"]}


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, Tensor)}
    return {**batch, **moved, "selection": batch["selection"].to(device, non_blocking=True)}


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
    if total < MIN_STEPS:
        log.warning("\n%s\nUNDER-TRAINED: only %d optimizer steps (fewer than %d): the drafter will accept far fewer tokens "
                    "than this data can teach. Lower train.batch_tokens (now %d) or raise train.epochs (now %d).\n%s",
                    "!" * 100, total, MIN_STEPS, cfg.batch_tokens, cfg.epochs, "!" * 100)


@dataclass
class TrainState:
    """What a checkpoint must restore besides model, optimizer and scheduler."""

    step: int = 0  # optimizer steps done; also the data position
    best: dict | None = None  # best validation summary so far, with its "step"
    history: list = field(default_factory=list)  # every logged (step, prefix, metrics), replayed on resume


def train_step(model, head: VerifierHead, micro: list[dict], optimizer, scheduler, cfg: TrainConfig, world: World) -> tuple[Tensor, Tensor]:
    """One optimizer step over this process's micro-batches; returns (metric sums [6, K], grad norm).

    The loss is normalised by the valid-position counts of the *global* batch (all-reduced before
    any backward), and multiplied by the world size because DDP/FSDP average gradients: the
    gradient equals that of one process holding the whole global batch.
    """
    targets = [head(b["final"], b["selection"].positions) for b in micro]  # no grad, once per batch
    counts = parallel.all_reduce_sum(sum(step_counts(t, b["selection"]) for t, b in zip(targets, micro)), world)
    sums = 0
    for i, (batch, target) in enumerate(zip(micro, targets)):
        with parallel.gradient_sync(model, enabled=i == len(micro) - 1), parallel.autocast(world.device):
            ce, step_sums = model(batch["input_ids"], batch["aux"], batch["position_ids"], target, batch["selection"])
            loss = ttt_loss(ce, counts, cfg.step_decay) * world.size
        loss.backward()
        sums = sums + step_sums
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return sums, norm


@torch.no_grad()
def validate(model, head: VerifierHead, dataset: Dataset, cfg: TrainConfig, world: World) -> dict[str, float]:
    """Metrics over the whole validation split (every process runs the same number of batches)."""
    net = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    rows = pack(dataset.lengths, cfg.pack_tokens)  # in index order
    size = cfg.micro_batch_rows
    per_round = size * world.size
    total = torch.zeros(6, cfg.ttt_steps, device=world.device)
    for j in range(math.ceil(len(rows) / per_round)):
        start = j * per_round + world.rank * size
        indices = sum(rows[start : start + size], [])
        batch = to_device(collate_ttt([dataset[i] for i in indices or [0]], cfg, size), world.device)
        with parallel.autocast(world.device):
            target = head(batch["final"], batch["selection"].positions)
            _, sums = net(batch["input_ids"], batch["aux"], batch["position_ids"], target, batch["selection"])
        total += sums if indices else 0  # an idle process still joins FSDP's collectives
    return StepMetrics(parallel.all_reduce_sum(total, world)).summary(cfg.step_decay)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(run_dir: Path, model, optimizer, scheduler, state: TrainState, world: World) -> None:
    """``latest.pt``: everything to resume; written atomically by the main process."""
    model_state, optim_state = parallel.full_state(model, optimizer)  # a collective under FSDP
    if world.main:
        save_atomic(run_dir / "latest.pt", {
            "model": model_state, "optimizer": optim_state, "scheduler": scheduler.state_dict(),
            "step": state.step, "best": state.best, "history": state.history, "rng": rng_state(),
        })
    parallel.barrier(world)


def save_best(run_dir: Path, model, state: TrainState, world: World) -> None:
    """``best.pt``: the weights of the best validation so far (what is exported at the end)."""
    model_state, _ = parallel.full_state(model)
    if world.main:
        save_atomic(run_dir / "best.pt", {"model": model_state, "step": state.step, "metrics": state.best})


def resume(run_dir: Path, model, optimizer, scheduler, world: World) -> TrainState:
    """The state of ``latest.pt`` loaded into model/optimizer/scheduler, or a fresh state."""
    path = run_dir / "latest.pt"
    if not path.is_file():
        return TrainState()
    saved = torch.load(path, map_location="cpu", weights_only=False)
    parallel.load_full_state(model, optimizer, saved["model"], saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    set_rng_state(saved["rng"])
    best = run_dir / "best.pt"
    if world.main and best.is_file() and torch.load(best, map_location="cpu", weights_only=False)["step"] > saved["step"]:
        best.unlink()  # written after the last checkpoint by the killed run; the replay rewrites it
    log.info("resumed %s at step %d", run_dir, saved["step"])
    return TrainState(step=saved["step"], best=saved["best"], history=saved["history"])


def save_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# The loop


def fit(ttt: TrainingTimeTest, head: VerifierHead, train_set: Dataset, val_set: Dataset, cfg: TrainConfig, seed: int,
        run_dir: Path, world: World, live=None) -> dict[str, Any]:
    """Train until the last step (resuming from ``run_dir``); returns the run summary.

    ``ttt`` and ``head`` are on ``world.device``; ``live`` (main process only) is a dvclive Live.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    check_lengths({"train": train_set, "val": val_set}, cfg.pack_tokens)
    batching = cfg.batching(world.size)
    plan = DataPlan(train_set.lengths, batching, seed, world.rank, world.size)
    total = cfg.max_steps or plan.steps(cfg.epochs)
    warmup = warmup_steps(cfg.warmup_fraction, total)
    if world.main:
        log.info("%d optimizer steps of %d tokens, %d of them warmup; per process and step: %d x %d packed rows of %d "
                 "tokens (micro-batches x rows), %d processes", total, cfg.batch_tokens, warmup, batching.grad_accum,
                 batching.batch_size, cfg.pack_tokens, world.size)
        warn_if_undertrained(total, cfg)
    model = parallel.wrap(ttt, world, cfg.fsdp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay, fused=world.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=total, floor=cfg.min_lr_ratio))
    state = resume(run_dir, model, optimizer, scheduler, world)
    for step, prefix, metrics in state.history:
        log_metrics(live, step, prefix, metrics)
    batches = iter(step_batches(train_set, plan, state.step, total, partial(collate_ttt, cfg=cfg, rows=batching.batch_size), cfg.num_workers,
                                world.device.type == "cuda"))
    window, clock = torch.zeros(6, cfg.ttt_steps, device=world.device), Window()
    while state.step < total:
        micro = [to_device(next(batches), world.device) for _ in range(batching.grad_accum)]
        sums, norm = train_step(model, head, micro, optimizer, scheduler, cfg, world)
        state.step += 1
        window += sums
        clock.add(sum(b["tokens"] for b in micro), norm)
        done = state.step == total
        if state.step % cfg.log_every == 0 or done:
            metrics = train_metrics(state.step, window, clock, scheduler.get_last_lr()[0], cfg, world)  # host sync
            record(live, state, "train", metrics)
            window.zero_()
        if state.step % cfg.val_every == 0 or done:
            metrics = validate(model, head, val_set, cfg, world)
            record(live, state, "val", metrics)
            if state.best is None or metrics["sim_accept_len"] > state.best["sim_accept_len"]:
                state.best = {**metrics, "step": state.step}
                save_best(run_dir, model, state, world)
        if state.step % cfg.checkpoint_every == 0 or done:
            save_checkpoint(run_dir, model, optimizer, scheduler, state, world)
    last = next((metrics for _, prefix, metrics in reversed(state.history) if prefix == "train"), {})
    return {"steps": total, "train": last, "best": state.best}


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


def train_metrics(step: int, window: Tensor, clock: Window, lr: float, cfg: TrainConfig, world: World) -> dict[str, float]:
    metrics = StepMetrics(parallel.all_reduce_sum(window.clone(), world)).summary(cfg.step_decay)
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


def log_metrics(live, step: int, prefix: str, metrics: dict[str, float]) -> None:
    if live is None:
        return
    live.step = step
    for name, value in metrics.items():
        live.log_metric(f"{prefix}/{name}", value)


# ---------------------------------------------------------------------------------------------
# Inputs and outputs


def verifier_parts(folder: Path) -> tuple[SimpleNamespace, dict[str, Tensor]]:
    """The verifier's LM config and the three tensors training needs (embedding, lm_head, final
    norm), read from its safetensors files without loading the model. A nested language model
    (``model.language_model``) has them under its prefix."""
    from safetensors import safe_open

    from eagle3.verifiers.loading import language_model, text_config_dict, weights_dir

    lm = language_model(folder)
    config = SimpleNamespace(**text_config_dict(folder, lm))
    wanted = {lm.prefix + name: key for key, name in VERIFIER_TENSORS.items()}
    found: dict[str, Tensor] = {}
    for file in sorted(weights_dir(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as part:
            found.update({wanted[name]: part.get_tensor(name) for name in wanted.keys() & set(part.keys())})
    if "head" not in found and getattr(config, "tie_word_embeddings", False) and "embed" in found:
        found["head"] = found["embed"]
    missing = [lm.prefix + VERIFIER_TENSORS[k] for k in VERIFIER_TENSORS if k not in found]
    if missing:
        raise UserError(f"{folder}: verifier weights lack {missing}")
    packed = [lm.prefix + VERIFIER_TENSORS[k] for k, t in found.items() if not t.is_floating_point()]
    if packed:
        raise UserError(f"{folder}: {packed} are quantized (packed integers); the drafter needs them in floating point")
    return config, found


def open_data(merged: Path, hidden_states: Path, fingerprint: str) -> tuple[Dataset, Dataset, dict, Tensor]:
    from safetensors.torch import load_file

    train_set, val_set = HiddenStates(merged, hidden_states, "train"), HiddenStates(merged, hidden_states, "val")
    meta = train_set.meta
    require_verifier(f"{merged}/meta.json", "built for", meta["verifier"]["fingerprint"], fingerprint)
    if meta.get("final_state") not in ("post-norm", "pre-norm"):
        raise UserError(f"{merged}/meta.json: final_state {meta.get('final_state')!r} is neither post-norm nor pre-norm")
    return train_set, val_set, meta, load_file(merged / "vocab.safetensors")["d2t"]


# ---------------------------------------------------------------------------------------------
# Run identity: the checkpoint folder is keyed by everything that determines the trained weights


def run_id(cfg: TrainConfig, draft: DraftConfig, fingerprint: str, seed: int, world: World, inputs: dict[str, str]) -> str:
    """Checkpoint folder name: changes with anything that would make resuming wrong.

    ``inputs``: content digests of every data file training reads (``training_inputs``). The code
    of training is included; export code is not (a rerun after an export change resumes the
    finished run and only re-exports).
    """
    code = [sha256_file(Path(__file__).parent / name) for name in TRAINING_CODE]
    return stable_hash({"train": cfg.__dict__, "draft": draft.to_dict(), "inputs": inputs, "code": code, "verifier": fingerprint,
                        "seed": seed, "world": world.size})


def training_inputs(merged: Path, hidden_states: Path, shards: list[str], cache: Path) -> dict[str, str]:
    """sha256 of every file of ``merged`` and of the referenced hidden-state shards, by relative path."""
    files = {f"merged/{p.relative_to(merged)}": p for p in sorted(merged.rglob("*")) if p.is_file()}
    for shard in shards:
        folder = hidden_states / shard
        files.update({f"hidden_states/{p.relative_to(hidden_states)}": p for p in sorted(folder.rglob("*")) if p.is_file()})
    return content_digests(files, cache)


def content_digests(files: dict[str, Path], cache: Path) -> dict[str, str]:
    """sha256 of each file's whole content; a digest is reused while the file's stat is unchanged.

    Why full content and not sampled bytes or sizes: one flipped byte in a part must give another
    run id. Why the stat cache: rehashing terabytes of hidden states on every resume would cost
    minutes per TB. A cached digest is reused only while (device, inode, size, mtime, ctime) is
    unchanged — the test DVC itself uses to skip rehashing, plus ctime, which no user tool can set
    back — so any write to a file, or a different file restored in its place, is hashed again.
    Files are hashed in parallel threads (hashlib releases the GIL), with a progress bar.
    """
    known = json.loads(cache.read_text()) if cache.is_file() else {}
    stats = {name: file_stat(path) for name, path in files.items()}
    todo = {name: path for name, path in files.items() if known.get(str(path.resolve()), {}).get("stat") != stats[name]}
    progress = tqdm(total=sum(stats[name][2] for name in todo), desc="hash inputs", unit="B", unit_scale=True, disable=not todo)

    def digest(path: Path) -> str:
        hasher = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(1 << 24):
                hasher.update(block)
                progress.update(len(block))
        return hasher.hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        fresh = dict(zip(todo, pool.map(digest, todo.values())))
    progress.close()
    if fresh:
        known.update({str(files[name].resolve()): {"stat": stats[name], "sha256": sha} for name, sha in fresh.items()})
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        write_json(tmp, known)
        os.replace(tmp, cache)
    return {name: fresh.get(name) or known[str(path.resolve())]["sha256"] for name, path in files.items()}


def file_stat(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def lock_run(run_dir: Path) -> int:
    """An exclusive lock on ``run_dir`` (the open descriptor; closing it or exiting releases it);
    refuses when another trainer holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise UserError(f"{run_dir}: another trainer (pid {holder}) is writing this run; wait for it to end or stop it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def run_folder(paths: TrainPaths, shards: list[str], make_id, world: World) -> Iterator[Path]:
    """This run's checkpoint folder, locked by the main process until the block ends.

    The main process hashes the inputs, compares the shards' with what extract recorded, and takes
    the lock; the others get the folder from it.
    """
    run_dir, lock = None, None
    if world.main:
        inputs = training_inputs(paths.merged, paths.hidden_states, shards, paths.checkpoints / "digests.json")
        check_recorded_digests(paths.hidden_states, shards, inputs)  # before training: refuse damaged shards
        run_dir = paths.checkpoints / make_id(inputs=inputs)
        lock = lock_run(run_dir)
    try:
        yield parallel.broadcast_object(run_dir, world)
    finally:
        if lock is not None:
            os.close(lock)  # closing the descriptor releases the flock


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
    from eagle3.verifiers.loading import verifier_fingerprint

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
    norm = tensors["norm"] if meta["final_state"] == "pre-norm" else None
    head = VerifierHead(tensors["head"].to(world.device, dtype), d2t.to(world.device), norm, draft.rms_norm_eps).to(world.device)
    shards = sorted({row["shard"] for row in train_set.rows + val_set.rows})
    make_id = partial(run_id, cfg, draft, fingerprint=fingerprint, seed=seed, world=world)
    with run_folder(paths, shards, make_id, world) as run_dir:
        live = None
        if world.main:
            from dvclive import Live

            live = Live(str(paths.live), dvcyaml=False, save_dvc_exp=False)  # a fresh record; fit replays a resumed history
        summary = fit(TrainingTimeTest(drafter, cfg.ttt_steps), head, train_set, val_set, cfg, seed, run_dir, world, live)
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
