"""The ``train`` params section as training reads it: its schema, and how its global batch is cut
per process.

    cfg = TrainConfig.from_params(params.train)      # every key of conf/train/*.yaml
    cfg.batching(world.size)                         # the recipe's rows per step, split over the processes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.schema import (ABSENT, BOOL, FRACTION, FRACTION_ABOVE_0, FRACTION_BELOW_1, NON_NEGATIVE, NON_NEGATIVE_NUMBER,
                           POSITIVE, POSITIVE_NUMBER, Check, Lookup, integer, one_of, read_section, refuse, setting)


@dataclass(frozen=True)
class Batching:
    """How packed rows make an optimizer step (the ``train`` params of the same names)."""

    pack_tokens: int  # train.pack_tokens
    batch_size: int  # packed rows per micro-batch, per process
    grad_accum: int  # micro-batches per optimizer step, per process


@dataclass(frozen=True)
class TrainConfig:
    """The ``train`` params section and its schema: one field per key of conf/train/*.yaml, with its
    check (``eagle3.schema``), and the rules over several keys in ``relations``. Values come only
    from params.yaml: no field has a default, so a key missing there is an error, never a silent
    second value."""

    GROUP: ClassVar[str] = "train"

    ttt_steps: int = setting(POSITIVE)  # K: draft steps unrolled in training
    step_decay: float = setting(FRACTION_ABOVE_0)  # loss weight of TTT step k is step_decay**k
    loss_normalisation: str = setting(one_of("token", "sequence"))  # token: step k's loss: mean over valid targets; sequence: over documents
    optimizer: str = setting(one_of("adamw", "muon"))  # adamw; or muon: Muon on the hidden matrices, AdamW on the rest
    lr: float = setting(POSITIVE_NUMBER)  # peak learning rate (Muon's scaled to AdamW's update size)
    min_lr_ratio: float = setting(FRACTION)  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_fraction: float = setting(FRACTION_BELOW_1)  # share of the optimizer steps spent in linear warmup
    weight_decay: float = setting(NON_NEGATIVE_NUMBER)  # decoupled weight decay (AdamW's and Muon's)
    epochs: int = setting(POSITIVE)  # passes over the train split (when max_steps is 0)
    max_steps: int = setting(Check(integer(0), "an integer >= 0 (0: run the epochs)"))  # optimizer steps to run; 0: from epochs
    batch_tokens: int = setting(POSITIVE)  # global batch: packed-row tokens per optimizer step, over all processes
    micro_batch_rows: int = setting(POSITIVE)  # at most this many packed rows per forward, per process (what the GPU holds)
    pack_tokens: int = setting(POSITIVE)  # tokens per packed row; at least the longest sample
    lm_head_init: str = setting(one_of("random", "verifier"))  # random, or verifier: its lm_head rows of the draft vocabulary (and final norm)
    freeze_lm_head: bool = setting(BOOL)  # keep the lm_head at its verifier start
    clip: float = setting(POSITIVE_NUMBER)  # max global gradient norm
    log_every: int = setting(POSITIVE)  # optimizer steps between train metric lines (their numbers reach the host in batches: reporting.Window)
    val_every: int = setting(POSITIVE)  # optimizer steps between validations (and at the end)
    checkpoint_every: int = setting(POSITIVE)  # optimizer steps between resumable checkpoints (and at the end)
    fsdp: bool = setting(BOOL)  # FSDP instead of DDP (multi-process only)
    num_workers: int = setting(NON_NEGATIVE)  # DataLoader worker processes per training process
    compile: bool | str = setting(one_of("auto", True, False))  # auto: the TTT forward and the verifier head compiled on CUDA (not with fsdp); true, false
    cuda_graphs: bool | str = setting(one_of("auto", True, False))  # auto: the compiled step replayed as CUDA graphs on one CUDA process; true, false
    states_on_device: bool | str = setting(one_of("auto", True, False))  # auto: every split's states held in the GPU's memory when they fit (training.resident); true, false

    @staticmethod
    def relations(get: Lookup) -> None:
        """The global batch in whole packed rows, shared evenly by the layout's processes; Muon not
        with FSDP; a frozen lm_head only at the verifier's start."""
        batch, row = get("train.batch_tokens"), get("train.pack_tokens")
        if ABSENT not in (batch, row) and batch % row:
            raise refuse("train.batch_tokens", batch, f"a multiple of train.pack_tokens ({row}): the global batch is whole packed rows")
        procs, nodes = get("layout.train_procs"), get("layout.nnodes")
        if ABSENT not in (batch, row, procs, nodes):
            problem = batch_share_problem(batch, row, procs * nodes, "layout.train_procs x layout.nnodes")
            if problem:
                raise refuse("train.batch_tokens", batch, problem)
        if get("train.optimizer") == "muon" and get("train.fsdp") is True:
            raise refuse("train.optimizer", "muon", "adamw with train.fsdp (Muon orthogonalises whole matrices, FSDP shards them)")
        if get("train.cuda_graphs") is True and get("train.compile") is False:
            raise refuse("train.cuda_graphs", True, "auto or false with train.compile false (the graphs replay the compiled step)")
        if get("train.freeze_lm_head") is True and get("train.lm_head_init") != "verifier":
            raise refuse("train.freeze_lm_head", True, "false unless train.lm_head_init is verifier (it keeps the lm_head at its start)")

    @classmethod
    def from_params(cls, section) -> TrainConfig:
        """The section's values (validated by the schema, relations and all; a misspelt key refused by the stage's key
        check, ``settings.check_section_keys``)."""
        return read_section(cls, section)

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
        share = self.batch_tokens // self.pack_tokens // processes  # relations: a whole number of rows
        micro = max(d for d in range(1, min(share, self.micro_batch_rows) + 1) if share % d == 0)
        return Batching(self.pack_tokens, micro, share // micro)

    def val_batching(self) -> Batching:
        """Validation's cut: ``micro_batch_rows`` rows a forward, nothing to accumulate."""
        return Batching(self.pack_tokens, self.micro_batch_rows, 1)


def batch_share_problem(batch_tokens: int, pack_tokens: int, processes: int, counted_by: str) -> str | None:
    """What train.batch_tokens must be so that ``processes`` training processes (their count as
    ``counted_by`` sets it) take equal shares of whole packed rows of the global batch, or None when
    they do. ``TrainConfig.relations`` checks the layout's count, ``batching`` the count torchrun started.

    Worked example: batch_tokens 6144, pack_tokens 2048 make 3 rows a step: None for 1 or 3
    processes; for 2, "a multiple of 4096: ... it makes 3 rows a step, which they cannot share
    evenly ..."; for 8, "a multiple of 16384: ... it makes 3 rows a step, fewer than the processes ...".
    """
    rows = batch_tokens // pack_tokens  # a whole number: checked before
    if rows % processes == 0:
        return None
    share = "fewer than the processes" if rows < processes else "which they cannot share evenly"
    return (f"a multiple of {processes * pack_tokens}: whole packed rows of train.pack_tokens ({pack_tokens}) for each of the "
            f"{processes} training processes ({counted_by}); it makes {rows} row{'s' * (rows != 1)} a step, {share}; "
            "the layout cuts the recipe's global batch, it never changes it")
