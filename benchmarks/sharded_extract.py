"""Benchmark of a sharded verifier in ``extract``: hidden states and tokens/s, one copy per GPU vs one copy over all.

    torchrun --nproc-per-node 2 benchmarks/sharded_extract.py models/verifier --device cuda --random-shape llama3-8b
    torchrun --nproc-per-node 2 benchmarks/sharded_extract.py models/verifier --device cuda --random-shape deepseek-v3 --ep
    torchrun --nproc-per-node 2 benchmarks/sharded_extract.py .eagle3/cache/tiny-kimi --trust-remote-code   # CPU, gloo
    torchrun --nproc-per-node 2 benchmarks/sharded_extract.py .eagle3/cache/tiny-random --smoke   # CPU, seconds

Why: ``layout.verifier: {tp, ep}`` decides whether ``extract`` runs a whole verifier per GPU
(replicated, each process on its share of the samples) or one copy sharded over the GPUs (every
process runs every sample). This measures both on the same samples, in the same processes:

- ``replicated``: each process loads a whole copy and extracts its share (``samples[rank::world]``);
  extraction tokens/s of all processes together, forward-only tokens/s, peak memory per process;
- ``sharded``: one copy over all processes (``Placement(tp=world, ep=world if --ep)``), every
  process runs every sample, rank 0 writes: the same figures;
- ``equality``: rank 0's final and tapped states of its replicated samples against the sharded
  ones (max abs and relative error; bf16 compute sums in another order, so not bit-equal).

``--random-shape`` replaces the weights by random ones (rank 0 builds them once, on its device):
``llama3-8b`` is Llama-3.1-8B's shape; ``deepseek-v3`` is a Kimi-K2.5-style checkpoint (text model
under ``language_model.`` in a wrapper config) with DeepSeek-V3's widths (hidden 7168, MLA ranks,
experts of 2048) and fewer layers and experts (4 layers, the first dense; 64 experts, 8 per token),
about 12B parameters, so that a whole copy fits on one GPU for the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from common import random_verifier
from eagle3.hidden_states.capture import Settings, batches, extract_samples, hidden_states
from eagle3.hidden_states.samples import prepare
from eagle3.lm.loading import WHOLE_COPY, Placement, load_tokenizer, load_verifier, text_config
from eagle3.lm.spec import LanguageModel, VerifierSpec
from extract_throughput import conversations
from shapes import VERIFIER_SHAPES

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=64,
    n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=131072, rope_theta=50000.0,
)
KIMI_STYLE = LanguageModel(config="text_config", prefix="language_model.", model_type="deepseek_v3")
SHAPES = {"llama3-8b": (VERIFIER_SHAPES["llama3-8b"], LanguageModel()),
          "deepseek-v3": ({"model_type": "kimi_k25", "text_config": {**DEEPSEEK_V3, "model_type": "kimi_k2"}}, KIMI_STYLE)}


def peak_gib(device: str) -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else 0.0


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def extraction_seconds(model, samples, settings: Settings, pad_id: int, write: bool) -> float:
    """One extraction of ``samples`` (encode, checks, parts written to a scratch folder when ``write``)."""
    with tempfile.TemporaryDirectory() as folder:
        return timed(lambda: extract_samples(model, samples, settings, Path(folder) if write else None, pad_id))


def forward_seconds(model, samples, settings: Settings, pad_id: int) -> float:
    return timed(lambda: [hidden_states(model, batch, settings.aux_layers, pad_id) for batch in batches(samples, settings.batch_tokens)])


def states(model, samples, settings: Settings, pad_id: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """id -> (aux, final) on the CPU, for the equality check."""
    out = {}
    for batch in batches(samples, settings.batch_tokens):
        _, aux, final = hidden_states(model, batch, settings.aux_layers, pad_id)
        for row, sample in enumerate(batch):
            n = len(sample.input_ids)
            out[sample.id] = (aux[row, :n].float().cpu(), final[row, :n].float().cpu())
    return out


def measure(model, samples, settings: Settings, pad_id: int, runs: int, write: bool, world: int, device: str) -> dict:
    """Median extraction and forward tokens/s over ``runs`` (max over processes: they run together), peak memory."""
    extraction_seconds(model, samples[:1], settings, pad_id, False)  # warm-up
    extract = [max_over_ranks(extraction_seconds(model, samples, settings, pad_id, write)) for _ in range(runs)]
    forward = [max_over_ranks(forward_seconds(model, samples, settings, pad_id)) for _ in range(runs)]
    return {"extract_s": round(statistics.median(extract), 3), "forward_s": round(statistics.median(forward), 3),
            "peak_gib_per_process": gather(peak_gib(device), world)}


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def gather(value: float, world: int) -> list[float]:
    values = [None] * world
    dist.all_gather_object(values, value)
    return values


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def compare(whole: dict, sharded: dict) -> dict:
    """Largest absolute and relative error of the sharded states against the whole copy's."""
    worst = {"aux_max_abs": 0.0, "final_max_abs": 0.0, "aux_rel": 0.0, "final_rel": 0.0}
    for sample_id, (aux, final) in whole.items():
        for name, a, b in (("aux", aux, sharded[sample_id][0]), ("final", final, sharded[sample_id][1])):
            worst[f"{name}_max_abs"] = max(worst[f"{name}_max_abs"], float((a - b).abs().max()))
            worst[f"{name}_rel"] = max(worst[f"{name}_rel"], float((a - b).norm() / a.norm()))
    return {key: float(f"{value:.3g}") for key, value in worst.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verifier", type=Path, help="a verifier folder (its tokenizer; its weights unless --random-shape)")
    parser.add_argument("--random-shape", choices=sorted(SHAPES), help="random weights of this shape")
    parser.add_argument("--ep", action="store_true", help="sharded run also splits the experts (ep = tp)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compute-dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1024, help="approximate tokens per sample")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the CPU, 4 short samples, one run: seconds on a tiny verifier "
                        "(tests/test_benchmarks.py runs it)")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.samples, args.tokens, args.runs = "cpu", 4, 48, 1

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    compute = args.compute_dtype or ("bfloat16" if args.device == "cuda" else "float32")
    params = OmegaConf.load("params.yaml")
    tokenizer = load_tokenizer(args.verifier, args.trust_remote_code)
    samples, _ = prepare(conversations(args.samples, args.tokens), tokenizer, VerifierSpec.from_params(params.model).chat.for_tokenizer(tokenizer), 8192)
    tokens, pad_id = sum(len(s.input_ids) for s in samples), tokenizer.pad_token_id or 0
    scratch = Path(tempfile.gettempdir()) / f"sharded-extract-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    verifier = args.verifier
    if args.random_shape:
        verifier = scratch / args.random_shape
        if rank == 0:  # random init of billions of parameters: seconds on a GPU
            config, lm = SHAPES[args.random_shape]
            random_verifier(config, verifier, f"cuda:{local_rank}" if args.device == "cuda" else "cpu", tokenizer=args.verifier,
                            lm=lm, name=f"random-{args.random_shape}")
        dist.barrier()
    depth = text_config(verifier, args.trust_remote_code).num_hidden_layers
    layers = (1, depth // 2, depth - 1)  # low, middle, high: the taps do not change the cost
    settings = Settings("bench", layers, "bfloat16", 8192, args.batch_tokens, 256 << 20, args.device, compute, world, 1, WHOLE_COPY)
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"

    mine, probe = samples[rank::world], samples[::world][:4]  # probe: rank 0's first samples, run by all when sharded
    whole = load_verifier(verifier, device, compute, args.trust_remote_code)
    report = {"replicated": measure(whole, mine, settings, pad_id, args.runs, True, world, args.device)}
    reference = states(whole, probe, settings, pad_id) if rank == 0 else {}
    del whole
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    placement = Placement(tp=world, ep=world if args.ep else 1)
    sharded = load_verifier(verifier, device, compute, args.trust_remote_code, placement)
    sharded_settings = replace(settings, placement=placement)
    report["sharded"] = measure(sharded, samples, sharded_settings, pad_id, args.runs, rank == 0, world, args.device)
    got = states(sharded, probe, sharded_settings, pad_id)  # collective: every rank runs the same samples
    for key in ("replicated", "sharded"):
        row = report[key]
        row["extract_tokens_per_s"] = round(tokens / row.pop("extract_s"), 1)
        row["forward_tokens_per_s"] = round(tokens / row.pop("forward_s"), 1)
    if rank == 0:
        report["equality"] = compare(reference, got)
        report = {"shape": args.random_shape or str(args.verifier), "processes": world, "placement": asdict(placement),
                  "device": args.device, "compute_dtype": compute, "samples": len(samples), "tokens": tokens, **report}
        print(json.dumps(report, indent=2))
    dist.barrier()
    if rank == 0 and args.random_shape:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
