"""Benchmark of the ``train`` stage's step: eager against compiled (``train.compile``) and against compiled and
replayed as CUDA graphs (graphed: ``train.cuda_graphs``, the selection padded to static sizes), at a recipe's shape.

    python benchmarks/train_throughput.py --smoke --out /tmp/smoke.json          # CPU, a tiny drafter, eager: seconds
    python benchmarks/train_throughput.py --device cuda --recipe 10k --out benchmarks/results/train_step_10k.json
    python benchmarks/train_throughput.py --device cuda --recipe 10k --modes compiled --iters 200 --out ...
    python benchmarks/train_throughput.py --device cuda --preset llama3-8b --recipe default --batch 4 --seq 2048 --out ...
    python benchmarks/train_throughput.py --device cuda --merged data/merged --hidden-states data/hidden_states --out ...
    python benchmarks/train_throughput.py --device cuda --modes compiled --loader-workers 4 [--states-on-device] [--validate] --out ...
    python benchmarks/train_throughput.py --device cuda --modes compiled graphed --loader-workers 4 --states-on-device --out ...
    python benchmarks/train_throughput.py --device cuda --modes graphed --iters 20 --kernel-builds 15 --out ...  # which kernels
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/train_throughput.py --device cuda --modes graphed --iters 20 \
        --profile-first-step 40 --out ...   # where a cold compile's seconds go in this process
    python benchmarks/train_throughput.py --device cuda --verifier models/verifier --params params.yaml --modes graphed --iters 1 --out ...
        # the step of train's drafter for that verifier, compiled into the compile caches before the stage runs
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --device cuda --out ...   # DDP (--fsdp: FSDP2)

Runs the stage's own pieces: the recipe's ``TrainConfig`` (conf/train/<recipe>.yaml), ``make_optimizers``
and its schedules, ``compile_step`` for the compiled and graphed modes, and ``train_step`` (verifier targets, the
K-step TTT forward, backward, clipping, optimizer step) on packed rows collated by the stage's
``collate_ttt`` on the host and moved by its ``to_device`` every step (pinned memory on GPUs), as
the stage's DataLoader hands them over; reading the shards is not measured. No host sync inside
the timed steps: on a GPU each step's time is the span between CUDA events recorded at the starts
of consecutive steps, so a host that falls behind shows as step time.

Documents are random, shaped like the 10k data by default (lengths uniform in [doc_tokens/2,
3 doc_tokens/2], the last ``--answer`` fraction of each under the loss mask), with random hidden
states of the ``--preset`` verifier's shape (no verifier files needed), or with ``--merged`` the
first samples of a real train split. Each mode starts from the same weights and takes the same
batches; the losses of the first ``--check-steps`` steps are compared across modes.

Writes JSON to ``--out``: {"commit", "command", "figures": {"shape": ..., "modes": {mode: {"median_step_s",
"tokens_per_s", "first_step_s" (compilation included), "gpu_util" (NVML, sampled over the timed steps),
"model_tflops", "mfu", "peak_memory_gib", "losses", "validation" (--validate: "seconds" of two validations,
"graphs_before", "graphs_after"), "kernel_builds" (--kernel-builds: "count", "total_s", "longest_s"), "compile_timers"
(compiled modes: torch.compile's largest, nested), "first_step_profile" (--profile-first-step: "own", "with_callees")}},
"loss_agreement": {"max_rel_diff", "agree"}}}.
Tokens are real (non-padding) tokens over all processes. FLOPs (``step_flops``), real tokens only:
6 x params per token for fc and the decoder layer on every row of every step; the lm_head on the
rows with a target (6 x H x Vd, or 4 x when frozen); causal attention within each document (plus
the chain keys of steps >= 1) x3 for the backward; 2 x H x V per target for the verifier head.
Imports eagle3.train, and so omegaconf (eagle3.config).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import dataclasses
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from common import ROOT, commit
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.hidden_states.loader import HiddenStates
from eagle3.training.config import TrainConfig
from eagle3.training.data import DataPlan, step_batches
from eagle3.training.loop import largest_compile_timers
from eagle3.training.loss import StepMetrics, TrainingTimeTest, VerifierHead
from eagle3.training.parallel import World, close_world, init_world, wrap
from eagle3.training.resident import Resident
from eagle3.training.step import (Optimisation, collate_ttt, compile_step, graphs, lr_factor, make_optimizers, to_device,
                                  train_step, validate, validation_batches, warmup_steps)
from offline.gpu_sampler import open_gpus, samples
from shapes import DRAFTER_SHAPES

SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=512, draft_vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=1024, aux_layers=(0, 1, 2))


def train_section(args: argparse.Namespace):
    """The ``train`` params to run: ``--params``' own section where given (the stage's settings, overrides included),
    else conf/train/<--recipe>.yaml over its ``defaults`` chain."""
    if args.params:
        return OmegaConf.load(args.params).train

    def load(stem: str):
        section = OmegaConf.load(ROOT / "conf" / "train" / f"{stem}.yaml")
        parents = [load(parent) for parent in section.pop("defaults", []) if parent != "_self_"]
        return OmegaConf.merge(*parents, section)

    return load(args.recipe)


def recipe(section, rows: int, **keys) -> TrainConfig:
    """The ``train`` params ``section`` with the layout's ``micro_batch_rows`` = ``rows``, then ``keys``."""
    return TrainConfig.from_params(OmegaConf.merge(section, {"micro_batch_rows": rows}, keys))


def random_draft_vocab(cfg: DraftConfig, generator: torch.Generator) -> torch.Tensor:
    """d2t of a random sorted subset of Vd target ids."""
    ids = torch.randperm(cfg.vocab_size, generator=generator)[: cfg.draft_vocab_size].sort().values
    return ids - torch.arange(cfg.draft_vocab_size)


def random_documents(cfg: DraftConfig, rows: int, seq: int, doc_tokens: int, answer: float, generator) -> list[dict]:
    """Random documents filling ``rows`` rows of ``seq`` tokens: whole rows (doc_tokens 0) or
    lengths uniform in [doc_tokens/2, 3 doc_tokens/2], as many as fit row by row; the last ``answer``
    fraction of each under the loss mask (``peer_speculators.py`` draws the same ones)."""
    lengths = []
    for _ in range(rows):
        left = seq
        while left > 0:
            n = seq if not doc_tokens else int(torch.randint(doc_tokens // 2, doc_tokens * 3 // 2 + 1, (1,), generator=generator))
            if n > left:
                break
            lengths.append(n)
            left -= n
    docs = []
    for n in lengths:
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[int(n * (1 - answer)) :] = True
        docs.append({"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=generator), "loss_mask": loss_mask,
                     "aux": torch.randn(n, 3 * cfg.hidden_size, generator=generator),
                     "final": torch.randn(n, cfg.hidden_size, generator=generator)})
    return docs


def real_documents(merged: str, hidden_states: str, cfg: TrainConfig, count: int, world: World) -> list[list[dict]]:
    """The items of the first ``count`` micro-batches the ``train`` stage would take from the train split."""
    dataset = HiddenStates(merged, hidden_states, "train")
    plan = DataPlan(dataset.lengths, cfg.batching(world.size), 0, world.rank, world.size)
    batches = [b for step in range(count) for b in plan.micro_batches(step)][:count]
    return [[dataset[i] for i in indices] for indices in batches]


def synthetic_split(args, draft: DraftConfig, batching) -> tuple[HiddenStates, HiddenStates, DataPlan]:
    """``--loader-workers``: random hidden states of the drafter's verifier shape written in the stage's format
    (``loader_throughput.write_hidden_states``: 2,000 samples, prompts and answers of the 10k data's ~170 and ~128
    tokens in an 8,192-token row, scaled to the row) into a temporary folder removed at exit: the train and val splits, and
    the train split's plan."""
    from loader_throughput import write_hidden_states

    root = Path(tempfile.mkdtemp(prefix="eagle3-train-bench-"))
    atexit.register(shutil.rmtree, root, True)
    shape = {"hidden_size": draft.hidden_size, "vocab_size": draft.vocab_size, "aux_layers": draft.aux_layers}
    prompt, answer = (max(2, batching.pack_tokens * n // 8192) for n in (170, 128))
    write_hidden_states(root, shape, samples=2000, prompt=prompt, answer=answer, part_bytes=256 << 20)
    dataset = HiddenStates(root / "merged", root / "hidden", "train")
    return dataset, HiddenStates(root / "merged", root / "hidden", "val"), DataPlan(dataset.lengths, batching, seed=0)


def pinned(batch: dict) -> dict:
    """A collated batch in page-locked memory, as the stage's loader hands it over on GPUs."""
    return {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in batch.items()}


def step_flops(cfg: DraftConfig, batch: dict, lengths: list[int], frozen_head: bool) -> float:
    """Model FLOPs of one step on one micro-batch of documents of ``lengths`` tokens (the module docstring)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * H * q + 2 * 2 * H * kv + q * H + 3 * H * I  # q, k, v (2H wide inputs), o, SwiGLU
    selection, tokens = batch["selection"], sum(lengths)
    steps = len(selection.rows)
    flops = 6 * 3 * H * H * tokens + 6 * layer * tokens * steps
    flops += sum((4 if frozen_head else 6) * H * cfg.draft_vocab_size * len(r) for r in selection.rows)
    causal_pairs = sum(n * (n + 1) / 2 for n in lengths)
    flops += 3 * sum(4 * q * (causal_pairs + k * tokens) for k in range(steps))  # QK^T and PV, fwd + bwd
    flops += 2 * H * cfg.vocab_size * len(selection.positions)  # frozen verifier head, forward only
    return flops


class UtilisationSampler:
    """The GPU's utilisation (offline/gpu_sampler.py's NVML samples) every ``interval`` s in a thread; None off GPUs."""

    def __init__(self, device: torch.device, interval: float = 0.05):
        self.samples: list[float] = []
        self.interval, self.stop, self.gpus = interval, threading.Event(), None
        if device.type == "cuda":
            self.gpus = open_gpus([device.index or 0])

    def __enter__(self):
        if self.gpus is not None:
            self.thread = threading.Thread(target=self.sample, daemon=True)
            self.thread.start()
        return self

    def sample(self) -> None:
        for _, util, _ in samples(*self.gpus, self.interval, self.stop):
            self.samples.append(util)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.gpus is not None:
            self.thread.join()

    def mean(self) -> float | None:
        return round(statistics.fmean(self.samples) / 100, 3) if self.samples else None


def make_model(draft: DraftConfig, cfg: TrainConfig, world: World, dtype: torch.dtype):
    """A fresh drafter (the same weights in every mode and process), its TTT module (compiled as ``cfg`` says,
    wrapped for the world) and verifier head."""
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(draft.vocab_size, draft.hidden_size, generator=generator) * 0.02).to(world.device, dtype)
    verifier_head = (torch.randn(draft.vocab_size, draft.hidden_size, generator=generator) * 0.02).to(world.device, dtype)
    d2t = random_draft_vocab(draft, generator).to(world.device)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(draft, embed).to(world.device)
    drafter.set_draft_vocab(d2t)
    drafter.init_head(verifier_head, torch.ones(draft.hidden_size, device=world.device))
    drafter.lm_head.requires_grad_(not cfg.freeze_lm_head)
    head = VerifierHead(verifier_head, d2t).to(world.device)
    ttt = TrainingTimeTest(drafter, cfg.ttt_steps, cfg.loss_normalisation)
    if cfg.compile:
        compile_step(ttt, head, graphs(cfg, world))
    return wrap(ttt, world, cfg.fsdp), head


def timed_kernel_builds() -> dict[str, float]:
    """Every Triton kernel torch.compile builds from now on, built in this process one at a time (compile threads 1),
    and its seconds, each also printed as it finishes: which kernels the first step's compile waits for (in the stage
    they build in parallel workers, and the wait is the longest chain of them)."""
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile

    config.compile_threads = 1
    builds, build = {}, AsyncCompile.triton

    def timed(self, kernel_name: str, *rest, **keys):
        start = time.perf_counter()
        try:
            return build(self, kernel_name, *rest, **keys)
        finally:
            builds[kernel_name] = builds.get(kernel_name, 0.0) + time.perf_counter() - start
            print(f"kernel build: {kernel_name} {builds[kernel_name]:.2f} s", file=sys.stderr, flush=True)

    AsyncCompile.triton = timed
    return builds


def heaviest_calls(profiler: cProfile.Profile, count: int) -> dict[str, list]:
    """The ``count`` functions of this process's main thread with the most time of the profiled step, by time spent in
    their own code ("own") and with what they called ("with_callees"): [seconds, calls, "file:line(function)"] each.
    Why: torch.compile's timers name its phases, not which of their functions the cold compile spends its seconds in
    (sympy, the partitioner, the scheduler, code generation); the kernel-building workers are other processes."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, with callees s, callers)}

    def ranked(column: int) -> list:
        heaviest = sorted(stats.items(), key=lambda item: -item[1][column])[:count]
        return [[round(row[column], 3), row[1], f"{file}:{line}({name})"] for (file, line, name), row in heaviest]

    return {"own": ranked(2), "with_callees": ranked(3)}


def verifier_shape(folder: Path, params: Path) -> DraftConfig:
    """The drafter ``train`` builds for the verifier in ``folder`` with the ``params`` file's taps and
    ``model.draft_head`` (``DraftConfig.from_verifier``, the verifier config's own floats: a compiled step bakes in such
    constants as the norms' epsilon), over ``merge.draft_vocab_size`` tokens capped at the verifier's vocabulary, as
    merge caps it."""
    from eagle3.lm.loading import verifier_parts
    from eagle3.lm.spec import VerifierSpec

    config, values = verifier_parts(folder)[0], OmegaConf.load(params)
    spec = VerifierSpec.from_params(values.model)
    draft_vocab = min(int(values.merge.draft_vocab_size), config.vocab_size)
    return DraftConfig.from_verifier(config, draft_vocab, spec.aux_layers, spec.draft_head)


def mode_config(cfg: TrainConfig, mode: str) -> TrainConfig:
    """The recipe with ``train.compile`` and ``train.cuda_graphs`` as ``mode`` (eager, compiled, graphed) says."""
    return dataclasses.replace(cfg, compile=mode != "eager", cuda_graphs=mode == "graphed")


def measure(args, draft: DraftConfig, cfg: TrainConfig, host_batches: list[dict], flops: list[float], world: World,
            dtype: torch.dtype) -> dict:
    """``args.warmup`` untimed steps (the first ones' losses kept), then ``args.iters`` timed steps cycling over the batches."""
    gpu = world.device.type == "cuda"
    static = graphs(cfg, world)
    if static:  # the selection as the stage's loader pads it for CUDA graphs
        host_batches = [{**b, "selection": b["selection"].pad(b["position_ids"].numel())} for b in host_batches]
        host_batches = [pinned(b) for b in host_batches] if gpu else host_batches
    builds = timed_kernel_builds() if args.kernel_builds and cfg.compile else None
    model, head = make_model(draft, cfg, world, dtype)
    optimizers = make_optimizers(model, cfg, fused=gpu)
    total = args.warmup + args.iters
    factor = partial(lr_factor, warmup=warmup_steps(cfg.warmup_fraction, total), total=total, floor=cfg.min_lr_ratio)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, factor) for optimizer in optimizers]

    loader = iter(args.loader(range(total), static)) if args.loader else None  # the stage's DataLoader, its workers started here
    dataset = args.dataset  # the loader's split (None without one): a Resident one gathers its rows on the device
    taken = []  # tokens of each step's batch

    def step(i: int) -> torch.Tensor:
        batch = next(loader) if loader else host_batches[i % len(host_batches)]
        taken.append(batch["tokens"])
        micro = [to_device(batch, world.device, dataset)]
        return train_step(model, head, micro, Optimisation(optimizers, schedulers), cfg, world)[0]

    profiler = cProfile.Profile() if args.profile_first_step else contextlib.nullcontext()
    start = time.perf_counter()
    with profiler:
        sums = [step(0)]
        if gpu:
            torch.cuda.synchronize()
    first_step_s = time.perf_counter() - start
    sums += [step(i) for i in range(1, args.warmup)]
    losses = [StepMetrics(s).summary(cfg.step_decay)["loss"] for s in sums[: args.check_steps]]  # host syncs, untimed
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    marks = []
    with UtilisationSampler(world.device) as utilisation:
        for i in range(args.warmup, total):
            marks.append(torch.cuda.Event(enable_timing=True) if gpu else time.perf_counter())
            if gpu:
                marks[-1].record()
            step(i)
        if gpu:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
            torch.cuda.synchronize()
        else:
            marks.append(time.perf_counter())
    if args.validate:
        result_validation = validation_times(args.val_split, model, head, cfg, world)
    spans = [(a.elapsed_time(b) / 1000 if gpu else b - a) for a, b in zip(marks, marks[1:])]
    median = statistics.median(spans)
    tokens = statistics.fmean(taken[args.warmup :])
    step_flop = statistics.fmean(flops[i % len(flops)] for i in range(args.warmup, total))
    result = {"median_step_s": round(median, 5), "mean_step_s": round(statistics.fmean(spans), 5),
              "tokens_per_s": round(world.size * tokens / median, 1), "first_step_s": round(first_step_s, 2),
              "model_tflops": round(step_flop / median / 1e12, 3), "gpu_util": utilisation.mean(), "losses": losses}
    if gpu:
        result["mfu"] = round(step_flop / median / 1e12 / args.peak_tflops, 4)
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.validate:
        result["validation"] = result_validation
    if args.profile_first_step:
        result["first_step_profile"] = heaviest_calls(profiler, args.profile_first_step)
        if world.main:  # under torchrun the main process's alone, as its figures are the ones written
            args.out.parent.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(args.out.with_name(f"{args.out.stem}.{args.mode}.prof"))  # all of it, for pstats
    if cfg.compile:
        result["compile_timers"] = largest_compile_timers(count=25)
    if builds is not None:
        longest = sorted(builds.items(), key=lambda item: -item[1])[: args.kernel_builds]
        result["kernel_builds"] = {"count": len(builds), "total_s": round(sum(builds.values()), 2),
                                   "longest_s": {name: round(seconds, 2) for name, seconds in longest}}
    return result


def validation_times(split, model, head: VerifierHead, cfg: TrainConfig, world: World) -> dict:
    """Two validations of ``split`` as ``train`` runs them (``validate``): each one's seconds, and the graphs compiled
    before and after (a compiled step should serve them without compiling anything)."""
    from torch._dynamo.utils import counters

    batches, graphs, seconds = validation_batches(split, cfg, world), [counters["stats"]["unique_graphs"]], []
    for _ in range(2):
        start = time.perf_counter()
        validate(model, head, batches, cfg, world)  # its metrics reach the host: synchronised
        seconds.append(round(time.perf_counter() - start, 2))
    graphs.append(counters["stats"]["unique_graphs"])
    return {"seconds": seconds, "graphs_before": graphs[0], "graphs_after": graphs[1]}


def loss_agreement(modes: dict[str, dict]) -> dict:
    """Largest relative difference of the first steps' losses between any mode and the first (eager)."""
    runs = [m["losses"] for m in modes.values() if "losses" in m]
    if len(runs) < 2:
        return {}
    worst = max(abs(a - b) / max(abs(a), 1e-12) for other in runs[1:] for a, b in zip(runs[0], other))
    return {"max_rel_diff": worst, "agree": worst < 1e-2}  # bf16 eager vs generated kernels: rounding only


def shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that fix the work of a step (shared with ``peer_speculators.py``)."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", choices=sorted(DRAFTER_SHAPES), help="drafter shape (default: smollm2-135m on cpu, llama3-8b on cuda)")
    parser.add_argument("--batch", type=int, help="packed rows per step (default: 1 on cpu, 4 on cuda)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: 512 on cpu, 2048 on cuda)")
    parser.add_argument("--ttt-steps", type=int, default=7, help="K")
    parser.add_argument("--doc-tokens", type=int, default=0, help="mean random document length (0: one document per row)")
    parser.add_argument("--answer", type=float, default=0.5, help="fraction of each random document under the loss mask")
    parser.add_argument("--iters", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU (H100/H200 SXM: 989)")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(parser)
    # Here the recipe fixes K and the row, and the documents are shaped like the 10k data's (~320 tokens, 128 of them answer).
    parser.set_defaults(preset="smollm2-135m", batch=1, ttt_steps=None, doc_tokens=320, answer=0.4, iters=100, warmup=10)
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON figures")
    parser.add_argument("--smoke", action="store_true", help="a tiny drafter on the CPU, a few steps: seconds (tests run it)")
    parser.add_argument("--verifier", type=Path, help="with --params: the drafter train builds for this verifier folder "
                        "instead of --preset's (e.g. models/verifier), with its own constants, such as the norms' epsilon, "
                        "which a compiled step bakes in: a compile here is one train's compile can find in the caches")
    parser.add_argument("--params", type=Path, help="with --verifier: a project's params.yaml, whose train section is the "
                        "recipe (instead of --recipe's) and whose merge.draft_vocab_size and model (taps, draft_head) "
                        "shape the drafter as train shapes it")
    parser.add_argument("--recipe", default="10k", help="conf/train/<recipe>.yaml: K, decay, optimizer, row length (default 10k)")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled", "graphed"],
                        help="default: eager and compiled (--smoke: eager)")
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    parser.add_argument("--check-steps", type=int, default=5, help="first steps whose losses are compared across modes")
    parser.add_argument("--loader-workers", type=int, help="read random hidden states written in the stage's format through "
                        "the stage's DataLoader with this many workers (pinned on GPUs), as train does, instead of "
                        "cycling collated batches")
    parser.add_argument("--states-on-device", action="store_true", help="with --loader-workers: the states held in the "
                        "device's memory and each row gathered there (train.states_on_device); the workers pack the rows")
    parser.add_argument("--validate", action="store_true", help="with --loader-workers: after the timed steps, two "
                        "validations of the val split as train runs them (the first one's time, the graphs compiled)")
    parser.add_argument("--merged", help="real data: the merge output folder (with --hidden-states)")
    parser.add_argument("--hidden-states", help="real data: the extracted shards folder")
    parser.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 instead of DDP")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--profile-first-step", type=int, default=0, metavar="N", help="profile the first step of each "
                        "mode (compiling it, where compiled) in this process's main thread with cProfile and keep its N "
                        "heaviest functions, and write the whole profile beside --out (OUT_STEM.MODE.prof, for "
                        "pstats; first_step_s then includes the profiler's overhead)")
    parser.add_argument("--kernel-builds", type=int, default=0, help="compiled modes: build the Triton kernels one at a "
                        "time in this process, timing each; the figures keep this many of the longest (first_step_s "
                        "is then serial: compare it with a run without)")
    args = parser.parse_args(argv)
    if bool(args.verifier) != bool(args.params):
        parser.error("--verifier and --params go together: the verifier's shape and the project's settings")
    if (args.states_on_device or args.validate) and args.loader_workers is None:
        parser.error("--states-on-device and --validate read the stage's format on disk: give --loader-workers N")
    if args.smoke:
        args.device, args.recipe, args.seq, args.doc_tokens = "cpu", "debug", 128, 40
        args.batches, args.iters, args.warmup, args.check_steps = 2, 2, 2, 2
    args.modes = args.modes or (["eager"] if args.smoke else ["eager", "compiled"])  # compiling on a CPU takes minutes
    if args.kernel_builds and [mode for mode in args.modes if mode != "eager"] != args.modes[-1:]:
        # the builds are timed once per process: a second compiled mode reuses the first one's kernels
        parser.error("--kernel-builds times one compiled mode, the last of --modes: give one (compiled or graphed)")
    args.warmup = max(args.warmup, args.check_steps, 1)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = init_world(args.device)
    gpu = world.device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    draft = verifier_shape(args.verifier, args.params) if args.verifier else DraftConfig.create(SMOKE_SHAPE if args.smoke else DRAFTER_SHAPES[args.preset], {})
    rows = args.batch
    section = train_section(args)
    base = recipe(section, rows)
    seq, ttt_steps = args.seq or base.pack_tokens, args.ttt_steps or base.ttt_steps
    cfg = recipe(section, rows, pack_tokens=seq, batch_tokens=rows * seq * world.size, ttt_steps=ttt_steps, fsdp=args.fsdp)
    batching = cfg.batching(world.size)
    args.loader = args.dataset = None
    if args.loader_workers is not None:  # items of the stage's own format on disk, read as the stage reads them
        dataset, args.val_split, plan = synthetic_split(args, draft, batching)
        if args.states_on_device:
            dataset, args.val_split = (Resident(d, world.device, "states to the device") for d in (dataset, args.val_split))
        args.dataset = dataset
        args.loader = lambda steps, static: step_batches(
            dataset, plan, steps, partial(collate_ttt, batching=batching, ttt_steps=cfg.ttt_steps, static=static),
            num_workers=args.loader_workers, pin_memory=gpu)
        items = [[dataset[i] for i in plan.micro_batches(step)[0]] for step in range(args.batches)]
    elif args.merged:
        items = real_documents(args.merged, args.hidden_states, cfg, args.batches, world)
    else:
        generator = torch.Generator().manual_seed(1 + world.rank)  # batches of its own on every process
        items = [random_documents(draft, rows, seq, args.doc_tokens, args.answer, generator) for _ in range(args.batches)]
    host_batches = [collate_ttt(docs, batching, cfg.ttt_steps) for docs in items]
    if gpu:
        host_batches = [pinned(b) for b in host_batches]
    lengths = [[len(d["input_ids"]) for d in docs] for docs in items]
    flops = [step_flops(draft, b, n, cfg.freeze_lm_head) for b, n in zip(host_batches, lengths)]
    shape = {"device": torch.cuda.get_device_name(world.device) if gpu else f"cpu x{torch.get_num_threads()} threads",
             "torch": torch.__version__, "processes": world.size, "parallel": ("fsdp" if args.fsdp else "ddp") if world.size > 1 else "none",
             "preset": str(args.verifier) if args.verifier else "smoke" if args.smoke else args.preset, "H": draft.hidden_size, "V": draft.vocab_size, "Vd": draft.draft_vocab_size,
             "recipe": section.name, "rows": rows, "seq": seq, "ttt_steps": cfg.ttt_steps, "optimizer": cfg.optimizer,
             "data": (f"random, the stage's format{', held on the device,' if args.states_on_device else ''} through "
                      f"{args.loader_workers} loader workers" if args.loader else args.merged
                      or f"random, doc_tokens {args.doc_tokens}, answer {args.answer}"),
             "documents_per_row": round(sum(map(len, lengths)) / len(lengths) / rows, 2),
             "targets_per_step": round(statistics.fmean(len(b["selection"].positions) for b in host_batches), 1),
             "padding_fraction": round(1 - sum(map(sum, lengths)) / (len(lengths) * rows * seq), 4),
             "dtype": str(dtype).removeprefix("torch."), "warmup": args.warmup, "iters": args.iters}
    modes = {}
    for mode in args.modes:
        args.mode = mode  # names the --profile-first-step file
        try:
            modes[mode] = measure(args, draft, mode_config(cfg, mode), host_batches, flops, world, dtype)
        except Exception as err:  # noqa: BLE001 (a mode that fails is a figure too; the others still run)
            modes[mode] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        if world.main:
            print(json.dumps({mode: modes[mode]}), flush=True)
    if world.main:
        figures = {"shape": shape, "modes": modes, "loss_agreement": loss_agreement(modes)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"commit": commit(), "command": " ".join(["python", *sys.argv]), "figures": figures}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(json.dumps(figures), flush=True)
    close_world(world)


if __name__ == "__main__":
    main()
