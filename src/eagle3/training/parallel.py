"""How training is spread over processes: torchrun setup, DDP/FSDP wrapping, collectives, state.

    torchrun --nproc-per-node 8 --nnodes 1 -m eagle3.train ...   # WORLD_SIZE/RANK/LOCAL_RANK set
    python -m eagle3.train ...                                     # world of one, no process group

Why: model.py and loss.py are single-device and never read the world size; everything
distributed is applied here from outside, in one fixed order (see ``wrap``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class World:
    """This process's place: rank among ``size`` processes, and its device."""

    rank: int
    size: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_world(device: str) -> World:
    """Join the torchrun process group (NCCL on GPUs, gloo on CPUs), or run alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
    else:
        where = torch.device(device)
    if size == 1:
        return World(0, 1, where)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo", device_id=where if where.type == "cuda" else None)
    return World(dist.get_rank(), dist.get_world_size(), where)


def close_world(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(x: Tensor, world: World) -> Tensor:
    """Sum of ``x`` over all processes (in place; no host sync)."""
    if world.size > 1:
        dist.all_reduce(x)
    return x


def broadcast_object(obj, world: World):
    """The main process's ``obj`` (picklable) on every process."""
    if world.size > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def wrap(module: nn.Module, world: World, fsdp: bool) -> nn.Module:
    """Data parallelism around the TTT module, applied last so it wraps everything else.

    Order: (1) FSDP shards the lm_head (the draft vocabulary's rows: the largest matrix) as its own unit, gathered for
    each step's logits and freed after, then the root: fc, the norms and the draft layer; or (2) DDP replicates the
    whole module. The frozen verifier embedding is a buffer: never sharded, reduced or broadcast.
    In a world of one, neither is applied.

    Why the draft layer is not a unit of its own: training-time test calls it once per step, and each call's attention
    reads the keys and values the earlier calls left in the KV cache, so gradients reach a call's parameters from the
    later calls' backward, and FSDP's per-call hooks mishandle them: with the draft layer a unit, two CPU processes
    trained other weights than one process, beyond the tolerance DDP meets; with the root and the lm_head as units they
    train the same (tests/test_train.py, two processes equal one).
    """
    if world.size == 1:
        return module
    if fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        gpu = world.device.type == "cuda"
        # bf16 compute copies, fp32 gradient reduction on GPUs. Only the root casts its inputs: the lm_head's
        # come from the root's own compute, already in its dtype.
        root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu else MixedPrecisionPolicy()
        inner = MixedPrecisionPolicy(param_dtype=root.param_dtype, reduce_dtype=root.reduce_dtype, cast_forward_inputs=False)
        fully_shard(module.drafter.lm_head, mp_policy=inner)
        fully_shard(module, mp_policy=root)
        return module
    # The buffers (RoPE frequencies, the draft vocabulary's map) are the same on every process: not re-sent each forward.
    # torch 2.13 names that switch forward_sync_buffers and warns at every process on the old name; older torches (a GPU
    # host's own) know only the old one.
    renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    no_resend = {"forward_sync_buffers": False} if renamed else {"broadcast_buffers": False}
    return DistributedDataParallel(module, device_ids=[world.device] if world.device.type == "cuda" else None, **no_resend)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulation."""
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    yield


def autocast(device: torch.device):
    """bf16 autocast on GPUs; full fp32 on CPUs (bf16 is several times slower there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def full_state(model: nn.Module, optimizers: list[torch.optim.Optimizer] | None = None) -> tuple[dict, dict | None]:
    """Unsharded CPU state dicts of the model and of its optimizers as one (None: model only), keyed by plain names.

    A collective under FSDP: every process calls it; the main process gets the tensors.
    """
    from torch.distributed.checkpoint import state_dict as dcp  # slow import: only here

    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizers is None:
        return dcp.get_model_state_dict(model, options=options), None
    return dcp.get_state_dict(model, optimizers, options=options)


def model_copy(model: nn.Module, world: World) -> dict | None:
    """A copy of the unsharded model state dict on the model's device, keyed by plain names, in the main process (every
    process calls it: a collective under FSDP); None in the others, which never read it (the main process alone
    checkpoints and exports), so that they do not hold a whole model beside their shard for the rest of the run.
    Why on the device: the copy queues behind the steps as any kernel does, where a copy to the host (``full_state``)
    waits for them and leaves the GPU idle while it is written out."""
    from torch.distributed.checkpoint import state_dict as dcp  # slow import: only here

    state = dcp.get_model_state_dict(model, options=dcp.StateDictOptions(full_state_dict=True))
    return {name: tensor.detach().clone() for name, tensor in state.items()} if world.main else None


def load_full_state(model: nn.Module, optimizers: list[torch.optim.Optimizer], model_state: dict, optim_state: dict) -> None:
    """Inverse of ``full_state``, on every process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
