"""A matrix of tiny random verifiers of different families through the whole pipeline on the CPU.

    python -m pytest -m families -s      # -s prints each family's stage timings

Each family is a transformers config of a real architecture at toy size (random weights, SmolLM2's
tokenizer and chat template), imported by the ``verifier`` stage's ``random`` source. The stages
run in-process through their ``main`` (as ``dvc repro`` runs them, minus the interpreter start):
verifier -> prompts -> generate -> extract -> merge -> train (4 steps) -> check-drafter ->
evaluate, which must be lossless (speculative output == plain greedy output on every prompt).
Prompts are longer than the sliding windows, so rolling back a sliding-window cache is exercised.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from support.models import TINY_LLAMA
from support.pipeline import SMALL_ROWS
from support.repo import ROOT
from eagle3 import evaluate, extract, generate, merge, prompts, train
from eagle3.common import write_jsonl
from eagle3.config import compose_params
from eagle3.drafter.export import check_drafter
from eagle3.verifier import import_verifier

pytestmark = pytest.mark.families

SHAPE = {k: TINY_LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                                     "bos_token_id", "eos_token_id", "pad_token_id")}
WINDOW = 16  # sliding window (tokens), shorter than every prompt (SmolLM2's template alone is ~30 tokens)
SLIDING = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]

# name -> the verifier's transformers config (model_type + toy sizes); what the family adds is spelled out.
FAMILIES = {
    "llama": dict(model_type="llama", **SHAPE, rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 1024}),
    "tied-embeddings": dict(TINY_LLAMA),  # SmolLM2's shape: lm_head is the embedding
    "qwen3": dict(model_type="qwen3", **SHAPE, tie_word_embeddings=False, rope_theta=1000000.0),  # q/k norms
    "mistral-sliding-window": dict(model_type="mistral", **SHAPE, sliding_window=WINDOW, tie_word_embeddings=False),
    "hybrid-per-layer-rope": dict(  # Gemma-3 style: sliding and full layers, one RoPE per layer type
        model_type="gemma3_text", **SHAPE, layer_types=SLIDING, sliding_window=WINDOW, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek-v3-moe": dict(  # MLA attention, routed experts after one dense layer, YaRN
        model_type="deepseek_v3", **{**SHAPE, "num_key_value_heads": 4}, tie_word_embeddings=False,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
}

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea.",
    "List the planets of the solar system in order from the sun, with one fact about each of them.",
    "Explain in two sentences why the sky is blue.", "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23? Show the steps.", "Give a haiku about autumn leaves falling on a quiet river.",
    "Summarise the plot of Romeo and Juliet in one paragraph.", "What does a compiler do?",
    "Name two mammals that can fly or glide.", "Write a Python function that reverses a string.",
    "Why do we have seasons on Earth?", "Describe a cat to someone who has never seen one.",
    "What is the boiling point of water at sea level in Fahrenheit?", "Suggest a name for a bakery.",
]
STAGES = ("verifier", "prompts", "generate", "extract", "merge", "train", "check", "evaluate")


def family_params(tmp: Path, family: str) -> Path:
    """params.yaml: the composed defaults at test size, the family as ``model``, a local prompt file."""
    path = tmp / "params.yaml"
    compose_params(["layout.threads=1", "generate.max_new_tokens=16", "merge.min_tokens=1", "merge.draft_vocab_size=2048",
                    *SMALL_ROWS, "evaluate.max_new_tokens=16", "evaluate.draft_tokens=3", "evaluate.sets=[heldout]"],
                   conf_dir=ROOT / "conf", output=path)
    params = OmegaConf.load(path)
    config = {**FAMILIES[family], "initializer_range": 0.2}  # larger random weights: varied answers, not one repeated token
    params.model.update(
        name=family, copy_weights=True, num_layers=config["num_hidden_layers"],
        max_position_embeddings=config["max_position_embeddings"], aux_layers=[1, 2, 3],
        source={"kind": "random", "tokenizer": str(tmp / "tokenizer"), "config": config, "seed": 0, "dtype": "float32"},
    )
    questions = Path("data") / "sources" / "questions.jsonl"  # relative: the seeded order hashes the source's name
    (tmp / questions.parent).mkdir(parents=True)
    write_jsonl(tmp / questions, [{"prompt": q + tail} for q in QUESTIONS for tail in ("", " Be brief.")])
    params.dataset.update(name="families", shards=["000000-000012"], eval_sets={"heldout": 3},
                          sources=[{"kind": "jsonl", "path": str(questions)}], heldout_fraction=0.25)
    OmegaConf.save(params, path)
    return path


def run_pipeline(tmp: Path, params: Path) -> dict[str, float]:
    """Every stage once; returns seconds per stage."""
    shard, p = "000000-000012", ["--params", str(params)]
    verifier, drafter, prompts_dir = tmp / "models" / "verifier", tmp / "models" / "drafter", tmp / "data" / "prompts"
    generated, states = tmp / "data" / "generated" / shard, tmp / "data" / "hidden_states"
    steps = {
        "verifier": lambda: import_verifier(OmegaConf.load(params).model, verifier),
        "prompts": lambda: prompts.main([str(verifier), str(prompts_dir), "--sources", str(tmp / "data" / "sources"), *p]),
        "generate": lambda: generate.main([str(verifier), str(prompts_dir / "shards" / f"{shard}.jsonl"), str(generated),
                                           "--journal-dir", str(tmp / "journal"), *p]),
        "extract": lambda: extract.main([str(verifier), str(generated), str(states / shard), *p]),
        "merge": lambda: merge.main([str(verifier), str(states), str(tmp / "data" / "merged"), str(tmp / "metrics"), *p]),
        "train": lambda: train.main([str(verifier), str(tmp / "data" / "merged"), str(states), str(drafter),
                                     "--checkpoints", str(tmp / "checkpoints"), "--live", str(tmp / "dvclive" / "train"),
                                     "--threads", "1", *p]),
        "check": lambda: check_drafter(drafter, verifier),
        "evaluate": lambda: evaluate.main([str(verifier), str(drafter), str(prompts_dir), str(tmp / "dvclive" / "evaluate"), *p]),
    }
    seconds = {}
    for name in STAGES:
        start = time.perf_counter()
        result = steps[name]()
        seconds[name] = time.perf_counter() - start
        if name == "check":
            assert result == [], result
    return seconds


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_goes_through_the_pipeline_losslessly(family, tmp_path, tiny_verifier_dir, one_thread, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the prompt source is named relative to it: the same prompts, order and packing every run
    (tmp_path / "tokenizer").symlink_to(tiny_verifier_dir)  # SmolLM2's tokenizer and chat template
    seconds = run_pipeline(tmp_path, family_params(tmp_path, family))
    metrics = json.loads((tmp_path / "dvclive" / "evaluate" / "metrics.json").read_text())["heldout"]
    generated = json.loads((tmp_path / "data" / "generated" / "000000-000012" / "stats.json").read_text())
    print(f"\n{family}: " + ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
          + f"; total {sum(seconds.values()):.1f} s; heldout: {metrics['prompts']} prompts, lossless chain {metrics['lossless']}"
          f" tree {metrics['tree']['lossless']}, tau {metrics['tau']:.2f} (tree {metrics['tree']['tau']:.2f},"
          f" baseline {metrics['baseline']['tau']:.2f}); {generated['answers']} answers")
    assert metrics["lossless"] == metrics["tree"]["lossless"] == 1 and metrics["prompts"] == 3
    trained = json.loads((tmp_path / "dvclive" / "train" / "metrics.json").read_text())
    assert trained["train"]["loss"] > 0 and trained["step"] == 4  # answers with loss tokens, really trained on
