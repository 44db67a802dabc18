"""Generated records for the data stages (extract, merge, train): conversations in the contract's shape, extract params, stored samples."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle3.common import write_jsonl
from eagle3.hidden_states.storage import read_rows
from support.repo import project_params

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens that the verifier accepts or rejects.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "def add(a, b):\n    return a + b",
    "Les chats dorment beaucoup pendant la journée.",
    "A prime number has exactly two divisors.",
    "Hidden states are stored in safetensors parts.",
    "The mitochondria is the powerhouse of the cell.",
]


def conversation(i: int, answer_sentences: int | None = None, reasoning: str | None = None) -> dict:
    """A generated record in the contract's shape (data/generated/<shard>/records.jsonl)."""
    n = answer_sentences if answer_sentences is not None else 1 + i % 4
    answer = " ".join(SENTENCES[(i + k) % len(SENTENCES)] for k in range(n))
    messages = [
        {"role": "user", "content": f"Question {i}: tell me about this. {SENTENCES[i % len(SENTENCES)]}"},
        {"role": "assistant", "content": answer, "reasoning_content": reasoning},
    ]
    return {
        "id": f"{i:016x}", "prompt_id": f"p{i:015x}", "source": "tests", "messages": messages,
        "finish_reason": "stop", "prompt_tokens": 0, "completion_tokens": 0, "generation": {"temperature": 0.0},
    }


def write_generated(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "records.jsonl", records)
    return folder


def tiny_params(tiny_model_params, **extract):
    """Project params with the tiny verifier's model section and small batches/parts."""
    params = project_params()
    params.model = tiny_model_params
    params.extract = OmegaConf.merge(params.extract, {"batch_tokens": 256, "part_bytes": 40_000, **extract})
    return params


def stored_sample(folder: Path, entry: dict) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(folder / entry["part"], framework="pt") as part:
        names = ["input_ids", "loss_mask", "aux", "aux_scale", "final", "final_scale"]
        return read_rows(part, names, entry["offset"], entry["offset"] + entry["length"])
