"""The ``train`` params section as training reads it, and how its global batch is cut per process.

    cfg = TrainConfig.from_params(params.train)      # every key of conf/train/*.yaml, none other
    cfg.batching(world.size)                         # the recipe's rows per step, split over the processes
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from eagle3.common import UserError, to_plain
from eagle3.config import batch_share_problem, refuse
from eagle3.training.data import Batching
from eagle3.training.parallel import World


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
