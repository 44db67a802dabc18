"""Benchmark of the ``train`` stage: real-token throughput and model FLOP utilisation of ``train_step``.

    python benchmarks/train_throughput.py                                  # CPU, SmolLM2-shaped drafter
    python benchmarks/train_throughput.py --device cuda                    # GPU, Llama-3.1-8B-shaped drafter
    python benchmarks/train_throughput.py --device cuda --doc-tokens 250   # ragged documents packed into the rows
    python benchmarks/train_throughput.py --device cuda --lm-head frozen trainable   # both, one process
    python benchmarks/train_throughput.py --device cuda --preset smollm2-135m --batch 8 \\
        --merged data/merged --hidden-states data/hidden_states     # real hidden states, packed as `train` packs them
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --device cuda         # DDP (--fsdp: FSDP2)

Runs the stage's own ``eagle3.train.train_step`` (verifier targets, K-step TTT forward, backward,
clipping, AdamW, schedule) on micro-batches of ``--batch`` rows of ``--seq`` tokens packed by the
stage's own ``eagle3.hidden_states.loader.collate``, already on the device (the data loader is not measured), with
bf16 autocast on GPUs and fp32 on CPUs, and no host sync inside the timed loop (one
``synchronize`` after it). Documents are random (whole rows by default; ``--doc-tokens N``: lengths
uniform in [N/2, 3N/2], the last ``--answer`` fraction of each under the loss mask) or, with
``--merged``, the first samples of the train split in the order the stage's first steps take them.
Random weights either way, the lm_head initialised from the verifier head's draft rows as ``train``
does. Prints one JSON line per ``--lm-head`` setting: tokens/s of real (non-padding) tokens, step
time, model TFLOP/s, MFU against ``--peak-tflops``, peak memory. Under torchrun every process
trains its own batch and tokens/s counts all of them; MFU is per GPU.

FLOPs counted (``step_flops``), real tokens only: 6 x params per token for fc and for the decoder
layer on every row of every step; the lm_head on the rows with a target (6 x H x Vd, or 4 x when
frozen: no weight gradient); causal attention within each document (plus the chain keys of steps
>= 1) x3 for the backward; 2 x H x V per target for the frozen verifier head (the draft logits and
the best logit of the rest).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3.drafter.loss import TrainingTimeTest, VerifierHead
from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.drafter.parallel import close_world, init_world, wrap
from eagle3.hidden_states.loader import DataPlan, HiddenStates
from eagle3.train import TrainConfig, collate_ttt, lr_factor, to_device, train_step
from shapes import DRAFTER_SHAPES


def train_config(**keys) -> TrainConfig:
    """The committed params' train section with ``keys`` replaced (TrainConfig has no defaults of its own;
    conf/train/default.yaml alone does not resolve: its batch size comes from the layout)."""
    default = OmegaConf.load(Path(__file__).parents[1] / "params.yaml").train
    return TrainConfig.from_params(OmegaConf.merge(default, keys))


def random_draft_vocab(cfg: DraftConfig, generator: torch.Generator) -> torch.Tensor:
    """d2t of a random sorted subset of Vd target ids."""
    ids = torch.randperm(cfg.vocab_size, generator=generator)[: cfg.draft_vocab_size].sort().values
    return ids - torch.arange(cfg.draft_vocab_size)


def random_documents(cfg: DraftConfig, rows: int, seq: int, doc_tokens: int, answer: float, generator) -> list[dict]:
    """Random documents filling ``rows`` rows of ``seq`` tokens: whole rows (doc_tokens 0) or
    lengths uniform in [doc_tokens/2, 3 doc_tokens/2], as many as fit row by row."""
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


def real_micro_batches(merged: str, hidden_states: str, cfg: TrainConfig, count: int, world) -> list[list[dict]]:
    """The first ``count`` micro-batches (items) the ``train`` stage would take from the train split."""
    dataset = HiddenStates(merged, hidden_states, "train")
    plan = DataPlan(dataset.lengths, cfg.batching(world.size), 0, world.rank, world.size)
    batches = [b for step in range(count) for b in plan.micro_batches(step % (cfg.max_steps or plan.steps(cfg.epochs)))][:count]
    return [[dataset[i] for i in indices] for indices in batches]


def step_flops(cfg: DraftConfig, batch: dict, lengths: list[int], frozen_head: bool) -> float:
    """Model FLOPs of one optimizer step on one micro-batch of documents of ``lengths`` tokens
    (real tokens only; see the module docstring)."""
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


def measure(args, cfg: DraftConfig, micro: list[dict], flops: list[float], frozen: bool, world, dtype) -> dict:
    """Warm up, then time ``args.iters`` optimizer steps cycling over the micro-batches (of ``flops``)."""
    gpu = world.device.type == "cuda"
    generator = torch.Generator().manual_seed(0)  # the same weights on every process
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02).to(world.device, dtype)
    verifier_head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02).to(world.device, dtype)
    drafter = Eagle3Drafter(cfg, embed).to(world.device)
    d2t = random_draft_vocab(cfg, generator).to(world.device)
    drafter.set_draft_vocab(d2t)
    drafter.init_head(verifier_head, torch.ones(cfg.hidden_size, device=world.device))
    drafter.lm_head.requires_grad_(not frozen)
    head = VerifierHead(verifier_head, d2t).to(world.device)
    train_cfg = train_config(ttt_steps=args.ttt_steps)
    model = wrap(TrainingTimeTest(drafter, args.ttt_steps, train_cfg.loss_normalisation), world, args.fsdp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=train_cfg.lr, betas=(0.9, 0.95), fused=gpu)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 10, 1000, 0.1))
    for i in range(args.warmup):
        train_step(model, head, [micro[i % len(micro)]], optimizer, scheduler, train_cfg, world)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(args.iters):
        sums, _ = train_step(model, head, [micro[i % len(micro)]], optimizer, scheduler, train_cfg, world)
    if gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    tokens = sum(micro[i % len(micro)]["tokens"] for i in range(args.iters)) / args.iters
    flops = sum(flops[i % len(micro)] for i in range(args.iters)) / args.iters
    result = {"lm_head": "frozen" if frozen else "trainable", "step_s": round(seconds, 4),
              "tokens_per_s": round(world.size * tokens / seconds, 1), "model_tflops": round(flops / seconds / 1e12, 3),
              "loss_finite": bool(torch.isfinite(sums[0]).all())}
    if gpu:
        result["mfu"] = round(flops / seconds / 1e12 / args.peak_tflops, 4)
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.profile and world.main:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            train_step(model, head, micro[:1], optimizer, scheduler, train_cfg, world)
            if gpu:
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return result


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(parser)
    parser.add_argument("--lm-head", nargs="+", default=["frozen"], choices=["frozen", "trainable"], help="one run each")
    parser.add_argument("--merged", help="real data: the merge output folder (with --hidden-states)")
    parser.add_argument("--hidden-states", help="real data: the extracted shards folder")
    parser.add_argument("--batches", type=int, default=8, help="distinct micro-batches cycled through (real data)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 instead of DDP")
    parser.add_argument("--profile", action="store_true", help="also print the ops that take the most time in one step")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    preset = args.preset or ("llama3-8b" if gpu else "smollm2-135m")
    rows, seq = args.batch or (4 if gpu else 1), args.seq or (2048 if gpu else 512)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = init_world(args.device)
    dtype = torch.bfloat16 if gpu else torch.float32
    cfg = DraftConfig.create(DRAFTER_SHAPES[preset], {})
    packing = train_config(ttt_steps=args.ttt_steps, batch_tokens=rows * seq * world.size, micro_batch_rows=rows, pack_tokens=seq)
    if args.merged:
        items = real_micro_batches(args.merged, args.hidden_states, packing, args.batches, world)
    else:
        generator = torch.Generator().manual_seed(1 + world.rank)  # a batch of its own on every process
        items = [random_documents(cfg, rows, seq, args.doc_tokens, args.answer, generator)]
    micro = [to_device(collate_ttt(docs, packing.batching(world.size), packing.ttt_steps), world.device) for docs in items]
    for batch in micro:
        batch["aux"], batch["final"] = batch["aux"].to(dtype), batch["final"].to(dtype)
    doc_lengths = [[len(d["input_ids"]) for d in docs] for docs in items]
    shape = {"device": torch.cuda.get_device_name(0) if gpu else f"cpu x{torch.get_num_threads()} threads",
             "processes": world.size, "parallel": ("fsdp" if args.fsdp else "ddp") if world.size > 1 else "none",
             "preset": preset, "H": cfg.hidden_size, "V": cfg.vocab_size, "Vd": cfg.draft_vocab_size, "rows": rows, "seq": seq,
             "ttt_steps": args.ttt_steps, "data": args.merged or f"random, doc_tokens {args.doc_tokens or seq}",
             "documents_per_row": round(sum(map(len, doc_lengths)) / len(doc_lengths) / rows, 2),
             "padding_fraction": round(1 - sum(map(sum, doc_lengths)) / (len(doc_lengths) * rows * seq), 4),
             "dtype": str(dtype).removeprefix("torch.")}
    for setting in args.lm_head:
        frozen = setting == "frozen"
        flops = [step_flops(cfg, b, n, frozen) for b, n in zip(micro, doc_lengths)]
        result = measure(args, cfg, micro, flops, frozen, world, dtype)
        if world.main:
            print(json.dumps({**shape, **result}), flush=True)
    close_world(world)


if __name__ == "__main__":
    main()
