"""Stage ``prompts``: build the prompt shards and held-out evaluation sets from configured sources.

    python -m eagle3.prompts models/verifier data/prompts --metrics metrics/prompts.json   # reads params.yaml: seed, dataset

Each source (``dataset.sources``) lists its candidates in a seeded order (a keyed hash of each
record, so the order of two records never depends on what else is in the pool). Walking it,
each candidate is normalised to chat messages, deduplicated on the whole conversation (every turn,
system included, case and whitespace aside), kept out if a user turn is in a packaged eval set,
length-filtered in verifier tokens and sent to the unseen pool (a candidate of a folder that
``dataset.unseen_folders`` set apart), the held-out pool (decided by a hash of the conversation,
so it can never reach training) or to training; drops are counted by reason and by source
folder. The sources' training prompts are interleaved by their ``weight`` into one sequence; shard ``SSSSSS-EEEEEE``
is the slice [S, E) of it: a bigger dataset extends a smaller one and leaves its shards
byte-identical. The statistics (with each source's share) go to ``stats.json`` and ``--metrics``.

Sources (read by ``eagle3.prompt_sources.sources``): ``evals`` (chat samples shipped in the PyPI
package ``evals``, by folder), ``jsonl`` / ``parquet`` (local files), ``sharegpt`` (ShareGPT-style
conversations, a prompt per human turn) and ``hf`` (a HF dataset by name, where a hub is
reachable). Eval sets (``dataset.eval_sets``): ``heldout`` and ``unseen`` (from the held-out and
unseen pools of the same sources), the packaged ``humaneval``, ``math`` and ``mtbench``, and sets
read from any source kind, the last ones by ``eagle3.prompt_sources.eval_sets``.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.prompts")

import argparse
import json
import logging
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import UserError, atomic_dir, read_json, stable_hash, to_plain, write_json, write_jsonl
from eagle3.lm.chat import prompt_ids
from eagle3.lm.identity import CHAT_IDENTITY_FILE
from eagle3.lm.loading import load_tokenizer
from eagle3.lm.spec import ModelSettings, VerifierSpec
from eagle3.prompt_sources.config import DatasetSettings, shard_range
from eagle3.prompt_sources.eval_sets import eval_set_prompts, eval_set_specs
from eagle3.prompt_sources.messages import NotAPrompt, conversation_key, to_messages, user_keys
from eagle3.prompt_sources.order import interleave, order_key
from eagle3.prompt_sources.names import configured_sources, source_name
from eagle3.prompt_sources.sources import Candidate, check_local_sources, source_candidates, source_weights
from eagle3.settings import StageParams, keys_of, stage_params

log = logging.getLogger(__name__)

PARAMS = StageParams("seed", keys_of(DatasetSettings, "shards", "sources", "extra_sources", "eval_sets", "heldout_fraction",  # = dvc.yaml
                                     "unseen_folders", "max_prompt_tokens"),
                     keys_of(ModelSettings, "trust_remote_code"))
SIDES = ("train", "heldout", "unseen")


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
    training, and every prompt sent to one side: unseen by its folder, else training or held-out
    by its text."""

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
        try:
            messages = to_messages(raw if isinstance(raw, dict) else {})
        except NotAPrompt as err:
            self.drop(err.reason, candidate)
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
        if candidate.unseen:
            side = "unseen"
        else:
            side = "heldout" if is_heldout(key, self.seed, self.fraction) else "train"
        record = {"id": stable_hash(messages), "source": candidate.source, "messages": messages, "prompt_tokens": tokens}
        return side, record


class SourceStream:
    """One source's admitted prompts, drawn one side at a time; the other side's wait in a buffer."""

    def __init__(self, candidates: Iterator[Candidate], pool: Pool):
        self.candidates, self.pool = candidates, pool
        self.buffers: dict[str, deque] = {side: deque() for side in SIDES}

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


def build_prompts(dataset: DictConfig, seed: int, count_tokens) -> tuple[dict[str, list[dict]], dict[str, list[dict]], dict]:
    """Pure core: (train shards by name, eval sets by name, statistics)."""
    ranges = {name: shard_range(name) for name in dataset.shards}
    train_needed = max(stop for _, stop in ranges.values())
    eval_sets = eval_set_specs(dataset.eval_sets)
    counts = {name: spec.prompts for name, spec in eval_sets.items()}
    evals, eval_keys, eval_dropped = eval_set_prompts(eval_sets, seed, count_tokens, int(dataset.max_prompt_tokens))
    places = configured_sources(dataset)
    sources = [spec for _, spec in places]
    weights = source_weights(places)
    pool = Pool(count_tokens, seed, float(dataset.heldout_fraction), int(dataset.max_prompt_tokens), eval_keys)
    reports: list[dict] = [{} for _ in sources]
    unseen = dataset.get("unseen_folders", 0)
    streams = [SourceStream(source_candidates(spec, where, seed, unseen, report), pool)
               for (where, spec), report in zip(places, reports)]
    apart = {source_name(spec): r["unseen_folders"] for spec, r in zip(sources, reports) if "unseen_folders" in r}
    if "unseen" in counts and not apart:
        raise UserError("params.yaml: dataset.eval_sets.unseen needs folders kept out of training: set "
                        "dataset.unseen_folders (a share such as 0.05, or a count per evals source)")
    # Training first, then held-out, then unseen: the training sequence never depends on how many
    # eval prompts a scale asks for.
    train, train_counts = mix(streams, weights, "train", train_needed)
    heldout, heldout_counts = mix(streams, weights, "heldout", counts.get("heldout", 0))
    unseen_weights = [w if "unseen_folders" in r else 0.0 for w, r in zip(weights, reports)]
    unseen_set, unseen_counts = mix(streams, unseen_weights, "unseen", counts.get("unseen", 0)) if apart else ([], [])
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
    pooled = {"heldout": heldout, "unseen": unseen_set}
    evals = {**{name: pooled[name] for name in ("heldout", "unseen") if name in counts}, **evals}
    for name, records in evals.items():
        if len(records) < counts[name]:
            log.warning("eval set %s: %d prompts, not the %d asked for (the source has no more)", name, len(records),
                        counts[name])
    stats = {
        "train_prompts": len(train),
        "eval_prompts": {name: len(records) for name, records in evals.items()},
        "sources": {
            source_name(spec): source_stats(w, n, h, len(train), report, unseen_counts[i] if apart else 0)
            for i, (spec, w, n, h, report) in enumerate(zip(sources, weights, train_counts, heldout_counts, reports))
        },
        "dropped": dict(sorted(pool.dropped.items())),
        "dropped_by_folder": {folder: dict(sorted(c.items())) for folder, c in sorted(pool.dropped_by_folder.items())},
        "prompt_tokens": sum(r["prompt_tokens"] for r in train),
    }
    if apart:
        stats["unseen_folders"] = apart
    if eval_dropped:
        stats["eval_dropped"] = eval_dropped
    return shards, evals, stats


def source_stats(weight: float, train: int, heldout: int, total: int, report: dict, unseen: int) -> dict:
    """One source's line of the statistics; ``unseen`` and ``read`` (what reading its file found,
    e.g. a cut) only where the source has them."""
    stats = {"weight": round(weight, 4), "share": round(train / total, 4), "train": train, "heldout": heldout}
    if "unseen_folders" in report:
        stats["unseen"] = unseen
    read = {k: v for k, v in report.items() if k != "unseen_folders"}
    if read:
        stats["read"] = read
    return stats


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
    check_local_sources(configured_sources(params.dataset), args.sources)
    count_tokens = PromptCounter(load_tokenizer(args.verifier, VerifierSpec.from_params(params.model).trust_remote_code))
    shards, evals, stats = build_prompts(params.dataset, int(params.seed), count_tokens)
    meta: dict[str, Any] = {
        # the dep chat_identity.json's (not the verifier's identity: other weights, the same prompts); evaluate checks it
        "tokenizer": read_json(args.verifier / CHAT_IDENTITY_FILE)["tokenizer"],
        "seed": int(params.seed),
        "sources": [to_plain(spec) for _, spec in configured_sources(params.dataset)],
        "shards": list(shards),
    }
    write_prompts(args.out, shards, evals, stats, meta)
    if args.metrics:
        args.metrics.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.metrics, stats)
    log.info("prompts: %s", json.dumps(stats))
