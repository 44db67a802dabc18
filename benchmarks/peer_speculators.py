"""The peer's training step at this project's benchmark shapes: speculators' ``Eagle3DraftModel``.

    python benchmarks/peer_speculators.py --device cuda                    # Llama-3.1-8B-shaped, 4 x 2048 tokens
    python benchmarks/peer_speculators.py --device cuda --doc-tokens 250   # the same ragged documents as ours
    python benchmarks/peer_speculators.py --device cuda --preset smollm2-135m --batch 8
    python benchmarks/peer_speculators.py --smoke     # the CPU, a tiny drafter, one step: seconds (tests run it)

Why: ``train_throughput.py`` measures this project's ``train_step``; this script drives the peer
(``pip install speculators==0.9.0``, imported, never copied) the way its trainer does, on the same
random documents (``train_throughput.random_documents`` with the same seed), so that tokens/s of
real tokens compare like for like: its forward over the documents packed into one row with
document ids (its FlexAttention block mask), its verifier head cut to the draft vocabulary, its
lm_head frozen at the verifier's draft rows, the loss named by ``--loss`` (``kl_div``, fused, as its
trainer's default), bf16 autocast, backward, clipping at 1.0 and AdamW over the trainable
parameters. Prints one JSON line: tokens/s, step time, peak memory and the MFU of the FLOPs that
``train_throughput.step_flops`` counts for the same documents (the useful work, whoever does it).

Its package imports its data pipeline at import time (``datasets``, ``openai``, ``hs_connectors``):
where ``datasets`` (with ``pyarrow`` >= 24) is not installed, a stand-in module that refuses every
call is put in its place, since no data is loaded through it here. On a machine without them,
install from wheels with ``--no-deps``: speculators 0.9.0, hs_connectors 0.9.0, openai 2.54.0,
jiter, sniffio, distro. Without them ``--smoke`` runs this project's side only (the documents, their
collation and FLOPs) and says so: the tests run it where the peer is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import sys
import time
import types

import torch

from eagle3.drafter.model import DraftConfig
from eagle3.training.config import Batching
from eagle3.training.step import collate_ttt
from shapes import DRAFTER_SHAPES
from train_throughput import SMOKE_SHAPE, random_documents, random_draft_vocab, shape_arguments, step_flops


def import_peer():
    """``speculators`` (its Eagle3 model, config classes and loss resolver)."""
    import transformers  # noqa: F401 (first: it probes optional packages, and must not find a stand-in)

    missing = []
    for name in ("datasets",):  # imported by its data pipeline (load_from_disk), unused here
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = stand_in(name)
            missing.append(name)
    import speculators
    from speculators.losses.utils import resolve_loss_config

    for name in missing:
        del sys.modules[name]
    return speculators, resolve_loss_config


def stand_in(name: str) -> types.ModuleType:
    """A module whose every attribute refuses to be called: nothing is loaded through it here."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} is not installed: this benchmark uses no data or API through speculators")

    def attribute(key: str):
        if key.startswith("__"):  # module machinery (__file__, __path__, ...) is absent, as in a real module
            raise AttributeError(key)
        return refuse

    module.__getattr__ = attribute
    return module


def peer_model(speculators, cfg: DraftConfig, d2t: torch.Tensor, verifier_head: torch.Tensor, embed: torch.Tensor, attention: str,
               norm_before_residual: bool = True):
    """Its Eagle3DraftModel of our preset's shape, with the verifier's head and embedding set as its
    ``load_verifier_weights`` would set them from a checkpoint. ``norm_before_residual``: its trainer's
    default (True) adds the normed hidden state as the residual; False is our drafter (and the layer
    SGLang and vLLM serve)."""
    from transformers import LlamaConfig

    layer = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
                        max_position_embeddings=cfg.max_position_embeddings,
                        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})})
    layer._attn_implementation = attention
    config = speculators.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg.draft_vocab_size, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layers),
        speculators_config=speculators.SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[speculators.TokenProposalConfig.model_validate({"proposal_type": "greedy", "speculative_tokens": 7})],
            verifier=speculators.VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
    )
    model = speculators.Eagle3DraftModel(config)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + d2t] = True
    model.load_vocab_mappings(t2d, d2t)
    draft_rows = verifier_head[torch.arange(cfg.draft_vocab_size) + d2t]
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(draft_rows)
        model.verifier_lm_head.weight.copy_(draft_rows)
        model.verifier_norm.weight.fill_(1.0)
    return model


def packed_row(docs: list[dict], device, dtype) -> dict:
    """The documents as one packed row [1, L], the layout its trainer feeds."""
    lengths = [len(d["input_ids"]) for d in docs]
    return {
        "hidden_states": torch.cat([d["aux"] for d in docs])[None].to(device, dtype),
        "input_ids": torch.cat([d["input_ids"] for d in docs])[None].to(device),
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(device),
        "loss_mask": torch.cat([d["loss_mask"] for d in docs])[None].to(device),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device),
        "verifier_last_hidden_states": torch.cat([d["final"] for d in docs])[None].to(device, dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(parser)  # --batch rows of --seq tokens are packed into one row here
    parser.add_argument("--loss", default="kl_div", help="its loss name (its trainer's default for Eagle3: kl_div)")
    parser.add_argument("--loss-implementation", default="fused", choices=["fused", "eager"])
    parser.add_argument("--attention", help="its draft_attn_impl (default: simple_flex_attention on cuda; eager on cpu, "
                        "where FlexAttention has no backward)")
    parser.add_argument("--smoke", action="store_true", help="the CPU, train_throughput.py's tiny drafter, 128 tokens, one step "
                        "(without the peer installed: this project's side only)")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.seq, args.doc_tokens, args.ttt_steps, args.warmup, args.iters = "cpu", 128, 40, 3, 0, 1
    gpu = args.device == "cuda"
    preset = "smoke" if args.smoke else args.preset or ("llama3-8b" if gpu else "smollm2-135m")
    rows, seq = args.batch or (4 if gpu else 1), args.seq or (2048 if gpu else 512)
    device, dtype = torch.device(args.device), torch.bfloat16 if gpu else torch.float32

    cfg = DraftConfig.create(SMOKE_SHAPE if args.smoke else DRAFTER_SHAPES[preset], {})
    generator = torch.Generator().manual_seed(0)  # the weights train_throughput.py draws, in its order
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02
    verifier_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=generator) * 0.02
    d2t = random_draft_vocab(cfg, generator)
    docs = random_documents(cfg, rows, seq, args.doc_tokens, args.answer, torch.Generator().manual_seed(1))
    lengths = [len(d["input_ids"]) for d in docs]
    flops = step_flops(cfg, collate_ttt(docs, Batching(seq, rows, 1), args.ttt_steps), lengths, True)
    if args.smoke and importlib.util.find_spec("speculators") is None:
        print(json.dumps({"trainer": None, "note": "speculators is not installed: this project's side only", "preset": preset,
                          "documents": len(lengths), "tokens": sum(lengths), "model_tflop": round(flops / 1e12, 6)}))
        return
    speculators, resolve_loss_config = import_peer()
    attention = args.attention or ("simple_flex_attention" if gpu else "eager")
    model = peer_model(speculators, cfg, d2t, verifier_head, embed, attention).to(device)
    batch = packed_row(docs, device, dtype)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, fused=gpu)
    call = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 0.8, "loss_config": resolve_loss_config(args.loss, args.loss_implementation)}

    def step():
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=gpu):
            _, loss, _ = model(**batch, **call)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.iters):
        loss = step()
    if gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.iters
    result = {"trainer": f"speculators {importlib.metadata.version('speculators')}",
              "device": torch.cuda.get_device_name(0) if gpu else "cpu", "preset": preset, "rows": rows, "seq": seq,
              "ttt_steps": args.ttt_steps, "documents": len(lengths), "tokens": sum(lengths),
              "loss": f"{args.loss} ({args.loss_implementation})", "attention": attention, "step_s": round(seconds, 4),
              "tokens_per_s": round(sum(lengths) / seconds, 1), "model_tflops": round(flops / seconds / 1e12, 3),
              "loss_finite": bool(torch.isfinite(loss))}
    if gpu:
        result["mfu"] = round(flops / seconds / 1e12 / args.peak_tflops, 4)
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
