"""One optimizer step and one validation: the micro-batches on the device, the TTT forward, the
loss normalised over the global batch, backward, clipping, the optimizers (AdamW, or Muon beside
it) and their warmup-then-cosine schedule.

    optimizers = make_optimizers(model, cfg, fused=True)
    sums, norm = train_step(model, head, micro, Optimisation(optimizers, schedulers), cfg, world)
    val_batches = validation_batches(val_set, cfg, world)          # once a run: its reading workers are kept
    metrics = validate(model, head, val_batches, cfg, world)
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

import eagle3.training.parallel as parallel
from eagle3.training.config import Batching, TrainConfig
from eagle3.training.data import InOrder, ValidationSampler, collate
from eagle3.training.loss import StepMetrics, TrainingTimeTest, VerifierHead, select_rows, step_counts, ttt_loss
from eagle3.training.parallel import World

# ---------------------------------------------------------------------------------------------
# Batches: the data order is training.data's DataPlan; here the TTT selection is added


def collate_ttt(items: list[dict[str, Tensor]], batching: Batching, ttt_steps: int, static: bool = False) -> dict[str, Any]:
    """``eagle3.training.data.collate`` into the packed rows of a micro-batch, plus the rows each
    of the ``ttt_steps`` TTT steps scores and the count of real tokens (host side); ``static``: the selection
    padded to one of a few sizes (``Selection.pad``: what CUDA graphs replay, ``train.cuda_graphs``)."""
    batch = collate(items, batching)
    selection = select_rows(batch.pop("loss_mask"), batch["position_ids"], ttt_steps)
    if static:
        selection = selection.pad(batch["position_ids"].numel())
    return {**batch, "selection": selection}


def to_device(batch: dict[str, Any], device: torch.device, dataset: Dataset | None = None) -> dict[str, Any]:
    """The micro-batch of ``dataset`` on ``device`` (asynchronous from pinned memory; the states gathered there
    when ``dataset`` holds them: ``training.resident``). The selection's sizes (targets, rows each TTT step
    scores) differ from batch to batch: they are marked dynamic for torch.compile (nothing else reads the
    mark), so a compiled step compiles once, not once static and then again dynamic."""
    moved = {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, Tensor)}
    if "token" in moved:
        moved.update(dataset.gather(moved.pop("token")))
    if device.type == "cpu":  # the CPU computes in float32: bf16-stored states widened, exactly (a GPU's autocast casts)
        moved.update({k: moved[k].float() for k in ("aux", "final")})
    selection = batch["selection"].to(device, non_blocking=True)
    for tensor in selection.tensors():
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    return {**batch, **moved, "selection": selection}


def compiles(cfg: TrainConfig, world: World) -> bool:
    """Whether ``train.compile`` compiles the step on this process's device."""
    if cfg.compile == "auto":
        return world.device.type == "cuda" and not cfg.fsdp
    return bool(cfg.compile)


def graphs(cfg: TrainConfig, world: World) -> bool:
    """Whether ``train.cuda_graphs`` replays the compiled step as CUDA graphs on this process (auto: where the step
    is compiled on one CUDA process: DDP's and FSDP's collectives run inside the backward)."""
    if cfg.cuda_graphs == "auto":
        return compiles(cfg, world) and world.device.type == "cuda" and world.size == 1
    return bool(cfg.cuda_graphs)


def compile_step(ttt: TrainingTimeTest, head: VerifierHead, cuda_graphs: bool = False) -> None:
    """``train.compile``: the TTT unroll (forward and, through autograd, backward: loss, metrics, attention,
    the soft cross-entropy over the draft vocabulary) and the verifier head compiled into generated
    kernels, in place (state dicts keep their names). Why: eager, each op of the unroll is a kernel
    launched from Python, and at the 10k recipe's shape the host, not the GPU, set the pace (one H200
    read 2-13 % busy). The optimizer (fused AdamW) and the clipping stay eager: a few multi-tensor
    kernels each.

    ``cuda_graphs`` (``train.cuda_graphs``): the compiled graphs are also captured as CUDA graphs and replayed
    (``reduce-overhead``), one capture per selection size (``Selection.pad`` keeps them few). Why: compiled, the
    10k step still launched its kernels one by one from Python, 14.6 ms of host work a step against ~10 ms of GPU
    work (one H100: the host set the pace, NVML 40-50 % busy over the steps)."""
    mode = "reduce-overhead" if cuda_graphs else None
    ttt.compile(mode=mode)
    head.compile(mode=mode)


def start_compile_workers() -> None:
    """Start torch.compile's kernel-building worker processes now, in the background. Why: inductor starts them at its
    first compile, and builds in this process, one at a time, every kernel it asks for before they are ready (on a
    fresh host they import torch and Triton first); started here, they get ready while the stage loads its inputs."""
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def begin_graph_step(cuda_graphs: bool) -> None:
    """Tell the CUDA graphs that a new step begins (their outputs of the last one may be overwritten now): the
    graphs cannot see where a step that runs its forward without a backward (validation) ends."""
    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()

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


class Optimisation(NamedTuple):
    """The optimizers (``make_optimizers``) and their schedulers, one each, stepped together."""

    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LRScheduler]


def train_step(model, head: VerifierHead, micro: list[dict], optimisation: Optimisation, cfg: TrainConfig,
               world: World) -> tuple[Tensor, Tensor]:
    """One optimizer step over this process's micro-batches; returns (metric sums [6, K], grad norm).

    The loss is normalised by the counts (valid targets, or documents: ``cfg.loss_normalisation``)
    of the *global* batch (all-reduced before any backward), and multiplied by the world size
    because DDP/FSDP average gradients: the gradient equals that of one process holding the whole
    global batch.
    """
    begin_graph_step(graphs(cfg, world))
    targets = [head(b["final"], b["selection"].positions, b["selection"].padded) for b in micro]  # no grad, once per batch
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
    for optimizer, scheduler in zip(*optimisation):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return sums, norm


def validation_batches(dataset: Dataset, cfg: TrainConfig, world: World) -> DataLoader:
    """The validation split's micro-batches (``ValidationSampler``), read by ``train.num_workers`` processes that
    are kept between validations. Why: read in the training process, every row of the split was read, checked and
    collated while the GPU waited (45 validations a 10k run); workers started afresh would pay their start each time."""
    sampler = ValidationSampler(InOrder(dataset.lengths, cfg.val_batching(), world.rank, world.size))
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=partial(collate_ttt, batching=sampler.plan.batching,
                      ttt_steps=cfg.ttt_steps, static=graphs(cfg, world)), num_workers=cfg.num_workers,
                      pin_memory=world.device.type == "cuda",
                      persistent_workers=cfg.num_workers > 0)


def validate(model, head: VerifierHead, batches: DataLoader, cfg: TrainConfig, world: World) -> dict[str, float]:
    """Metrics over the whole validation split (``validation_batches``; every process runs the same number of batches).

    Where the step is compiled the forward runs with autograd recording, as in training, and its sums are detached
    (nothing is backpropagated): a compiled step is specialised on the grad mode, so under ``torch.no_grad`` the first
    validation compiled a second graph of the same forward (~30 s of a 10k run on one H200). Its values are the same
    either way; an eager step (CPUs, FSDP) validates under ``no_grad``, which holds no activations."""
    net = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    total = torch.zeros(6, cfg.ttt_steps, device=world.device)
    for step, batch in enumerate(batches):
        batch = to_device(batch, world.device, batches.dataset)
        begin_graph_step(graphs(cfg, world))
        with parallel.autocast(world.device), torch.set_grad_enabled(compiles(cfg, world)):
            target = head(batch["final"], batch["selection"].positions, batch["selection"].padded)
            sums = net(batch["input_ids"], batch["aux"], batch["position_ids"], target, batch["selection"])[1].detach()
        total += sums if batches.batch_sampler.counted(step) else 0  # an idle process still joins FSDP's collectives
    return StepMetrics(parallel.all_reduce_sum(total, world)).summary(cfg.step_decay)
