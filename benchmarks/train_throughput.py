"""Benchmark of the ``train`` stage: training tokens/s and model FLOP utilisation of ``train_step``.

    python benchmarks/train_throughput.py                                  # CPU, SmolLM2-shaped drafter
    python benchmarks/train_throughput.py --device cuda                    # GPU, Llama-3.1-8B-shaped drafter
    python benchmarks/train_throughput.py --device cuda --batch 8 --seq 2048 --ttt-steps 7 --peak-tflops 989
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --device cuda         # DDP (--fsdp: FSDP2)

Runs the stage's own ``eagle3.train.train_step`` (verifier targets, K-step TTT forward, backward,
clipping, AdamW, schedule) on random weights and random hidden states already on the device (the
data loader is not measured), with bf16 autocast on GPUs and fp32 on CPUs, and no host sync
inside the timed loop (one ``synchronize`` after it). Prints one JSON line: tokens/s (every
position of every sequence), step time, model TFLOP/s, MFU against ``--peak-tflops`` and peak
memory. Under torchrun every process trains its own batch (the model wrapped as the ``train`` stage
wraps it) and tokens/s counts all of them; MFU is per GPU. FLOPs counted (``step_flops``): 6 x params per token for fc, the decoder layer on every
row of every step and the lm_head on the rows that have a target; causal attention (plus the
chain keys of steps >= 1) x3 for the backward; 2 x H x V per target position for the frozen
verifier head (the full-vocab logits decide which targets are in the draft vocab).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3.loss import Selection, TrainingTimeTest, VerifierHead, select_rows
from eagle3.model import DraftConfig, Eagle3Drafter
from eagle3.parallel import close_world, init_world, wrap
from eagle3.train import TrainConfig, lr_factor, train_step


def random_draft_vocab(cfg: DraftConfig, generator: torch.Generator) -> torch.Tensor:
    """d2t of a random sorted subset of Vd target ids."""
    ids = torch.randperm(cfg.vocab_size, generator=generator)[: cfg.draft_vocab_size].sort().values
    return ids - torch.arange(cfg.draft_vocab_size)


def random_batch(cfg: DraftConfig, batch: int, seq: int, answer: float, steps: int, device, dtype, generator) -> dict:
    """One micro-batch as ``to_device`` gives it: the last ``answer`` fraction of each row is masked in."""
    loss_mask = torch.zeros(batch, seq, dtype=torch.bool)
    loss_mask[:, int(seq * (1 - answer)) :] = True
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator).to(device),
        "aux": torch.randn(batch, seq, 3 * cfg.hidden_size, generator=generator).to(device, dtype),
        "final": torch.randn(batch, seq, cfg.hidden_size, generator=generator).to(device, dtype),
        "selection": select_rows(loss_mask, steps).to(device),
    }


def step_flops(cfg: DraftConfig, batch: int, seq: int, selection: Selection) -> float:
    """Model FLOPs of one optimizer step on one micro-batch (see the module docstring)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * H * q + 2 * 2 * H * kv + q * H + 3 * H * I  # q, k, v (2H wide inputs), o, SwiGLU
    steps = len(selection.rows)
    rows = batch * seq
    flops = 6 * 3 * H * H * rows + 6 * layer * rows * steps
    flops += sum(6 * H * cfg.draft_vocab_size * len(r) for r in selection.rows)  # lm_head on target rows
    causal_pairs = batch * seq * (seq + 1) / 2
    flops += 3 * sum(4 * q * (causal_pairs + k * rows) for k in range(steps))  # QK^T and PV, fwd + bwd
    flops += 2 * H * cfg.vocab_size * len(selection.positions)  # frozen verifier head, forward only
    return flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", help="drafter shape (default: smollm2-135m on cpu, llama3-8b on cuda)")
    parser.add_argument("--batch", type=int, help="sequences per step (default: 2 on cpu, 4 on cuda)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: 512 on cpu, 2048 on cuda)")
    parser.add_argument("--ttt-steps", type=int, default=7, help="K")
    parser.add_argument("--answer", type=float, default=0.5, help="fraction of each sequence under the loss mask")
    parser.add_argument("--iters", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (0: torch's default)")
    parser.add_argument("--fsdp", action="store_true", help="under torchrun: FSDP2 instead of DDP")
    parser.add_argument("--profile", action="store_true", help="also print the ops that take the most time in one step")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU (H100/H200 SXM: 989)")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    preset = args.preset or ("llama3-8b" if gpu else "smollm2-135m")
    batch, seq = args.batch or (4 if gpu else 2), args.seq or (2048 if gpu else 512)
    if args.threads:
        torch.set_num_threads(args.threads)
    world = init_world(args.device)
    device = world.device
    dtype = torch.bfloat16 if gpu else torch.float32
    generator = torch.Generator().manual_seed(0)  # the same weights on every process

    cfg = DraftConfig.preset(preset)
    embed = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02).to(device, dtype)
    drafter = Eagle3Drafter(cfg, embed).to(device)
    d2t = random_draft_vocab(cfg, generator).to(device)
    drafter.set_draft_vocab(d2t)
    head = VerifierHead((torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02).to(device, dtype), d2t).to(device)
    train_cfg = TrainConfig(ttt_steps=args.ttt_steps)
    model = wrap(TrainingTimeTest(drafter, args.ttt_steps), world, args.fsdp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_cfg.lr, betas=(0.9, 0.95), fused=gpu)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, 10, 1000, 0.1))
    generator.manual_seed(1 + world.rank)  # but a batch of its own
    micro = [random_batch(cfg, batch, seq, args.answer, args.ttt_steps, device, dtype, generator)]

    for _ in range(args.warmup):
        train_step(model, head, micro, optimizer, scheduler, train_cfg, world)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.iters):
        sums, _ = train_step(model, head, micro, optimizer, scheduler, train_cfg, world)
    if gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    flops = step_flops(cfg, batch, seq, micro[0]["selection"])
    result = {
        "device": torch.cuda.get_device_name(0) if gpu else f"cpu x{torch.get_num_threads()} threads",
        "processes": world.size, "parallel": ("fsdp" if args.fsdp else "ddp") if world.size > 1 else "none",
        "preset": preset, "H": cfg.hidden_size, "V": cfg.vocab_size, "Vd": cfg.draft_vocab_size, "batch": batch, "seq": seq,
        "ttt_steps": args.ttt_steps, "answer_fraction": args.answer, "dtype": str(dtype).removeprefix("torch."),
        "step_s": round(seconds, 4), "tokens_per_s": round(world.size * batch * seq / seconds, 1),
        "model_tflops": round(flops / seconds / 1e12, 3), "loss_finite": bool(torch.isfinite(sums[0]).all()),
    }
    if gpu:
        result["mfu"] = round(flops / seconds / 1e12 / args.peak_tflops, 4)
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if world.main:
        print(json.dumps(result))
    if args.profile and world.main:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
            train_step(model, head, micro, optimizer, scheduler, train_cfg, world)
            if gpu:
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total", row_limit=15, max_name_column_width=60))
    close_world(world)


if __name__ == "__main__":
    main()
