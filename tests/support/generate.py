"""Stage ``generate`` on test prompts: composed params, prompt shards of the tiny questions, one stage run, its output bytes."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from eagle3.backends.base import Generation
from eagle3.common import stable_hash, write_jsonl
from eagle3.config import compose_params
from eagle3.generate import run_stage
from eagle3.lm.chat import prompt_ids
from eagle3.lm.spec import VerifierSpec
from support.repo import ROOT

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]


def stage_params(tmp_path: Path, *overrides: str):
    """params.yaml composed from conf/ (as DVC does) with test-sized overrides."""
    out = tmp_path / "params.yaml"
    compose_params(["layout.threads=1", *overrides], conf_dir=ROOT / "conf", output=out)
    return OmegaConf.load(out)


def generation(params) -> Generation:
    """The generation settings of composed ``params``, as the stage builds them."""
    return Generation.from_params(params.generate, VerifierSpec.from_params(params.model))


def prompt(tokenizer, text: str) -> dict:
    messages = [{"role": "user", "content": text}]
    return {"id": stable_hash(messages), "source": "test", "messages": messages,
            "prompt_tokens": len(prompt_ids(tokenizer, messages))}


def shard_file(tmp_path: Path, tokenizer, texts=QUESTIONS, name="000000-000003") -> Path:
    path = tmp_path / "prompts" / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [prompt(tokenizer, t) for t in texts])
    return path


def generate(tmp_path: Path, verifier: Path, prompts: Path, params, out: str = "out"):
    return run_stage(verifier, prompts, tmp_path / out, params, tmp_path / "journal", tmp_path / f"{out}.json")


def output_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}
