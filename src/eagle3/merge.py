"""Stage ``merge``: the training mixture over the extracted shards, and the draft vocabulary.

    python -m eagle3.merge models/verifier data/hidden_states data/merged metrics/merge --generated data/generated
    # params.yaml: seed, dataset.shards, dataset.sources, dataset.extra_sources, merge

Reads exactly the shards named in ``dataset.shards`` (never a directory listing: shards of a
bigger scale may still lie in the workspace) and writes references, not a copy of the tensors:

- ``manifest.jsonl``: one row per kept sample, in seeded-shuffle order: shard, index (line of the
  shard's index.jsonl), id, part, offset, length, masked, split (``train`` | ``val``; a prompt's answers share one);
- ``vocab.safetensors``: ``d2t`` int64 [Vd] (target id = draft id + d2t[draft id]), ``t2d`` bool [V];
- ``meta.json``: verifier, taps, shards, seed, params and the statistics.

The statistics also go to the metrics folder (4th argument) through dvclive: ``metrics.json``
and the length histogram ``plots/custom/length_histogram.json``.

``merge.source_repeats`` weighs the training split by source without generating or extracting anything again: each
sample's source is named from its generated record's ``source`` (``prompt_sources.names.source_of``), and a source
repeated r times has floor(r) copies of each of its samples, one more for a seeded share r - floor(r) of them. The
draft vocabulary counts the copies too, as training sees them.

Draft vocabulary (docs/design.md §1): count, over the *train* split, the tokens the drafter must
predict (``input_ids[t]`` where ``loss_mask[t]``), take the Vd = min(merge.draft_vocab_size, V)
most frequent, ties broken by the lower id, and sort them by id. When fewer than Vd distinct
tokens were seen, the same rule fills the rest with never-seen ids in ascending id order.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.merge")

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from eagle3.common import UserError, atomic_dir, prompt_group, read_json, read_jsonl, to_plain, write_json, write_jsonl
from eagle3.lm.loading import read_identity
from eagle3.lm.spec import require_verifier
from eagle3.prompt_sources.config import DatasetSettings
from eagle3.prompt_sources.names import configured_sources, source_of
from eagle3.settings import StageParams, keys_of, section, stage_params
from eagle3.training.mixture import MixtureSettings

log = logging.getLogger(__name__)

PARAMS = StageParams("seed", keys_of(DatasetSettings, "shards", "sources", "extra_sources"), section(MixtureSettings))  # = dvc.yaml

SHARD_KEYS = ("aux_layers", "hidden_size", "vocab_size", "layer_convention", "final_state")  # equal across shards


@dataclass
class Candidate:
    """One stored sample of a shard, with what merge needs to filter it and count its targets."""

    shard: str
    index: int  # line of the shard's index.jsonl
    entry: dict[str, Any]
    digest: str  # sha256 of its input_ids: exact duplicates share it
    targets: np.ndarray  # [masked] int32: the tokens the drafter must predict


def shard_meta(root: Path, shards: list[str], fingerprint: str) -> dict[str, Any]:
    """The shards' common meta.json fields; refuses another verifier or mixed taps."""
    if not shards:
        raise UserError("params.yaml: dataset.shards is empty")
    common: dict[str, Any] = {}
    for shard in shards:
        meta = read_json(root / shard / "meta.json")
        require_verifier(f"{root / shard}/meta.json", "extracted with", meta["verifier"]["fingerprint"], fingerprint)
        fields = {key: meta[key] for key in SHARD_KEYS}
        if common and fields != common:
            raise UserError(f"{root / shard}/meta.json: {fields} differs from the other shards' {common}; re-extract all shards")
        common = fields
    return common


def read_candidates(root: Path, shard: str) -> list[Candidate]:
    """The stored samples of one shard, with token ids read from its (memory-mapped) parts."""
    from safetensors import safe_open

    entries = list(read_jsonl(root / shard / "index.jsonl"))
    tokens = {}  # part -> (input_ids [N], loss_mask [N]): 5 bytes a token, the hidden states stay on disk
    for name in sorted({entry["part"] for entry in entries}):
        with safe_open(root / shard / name, framework="numpy") as part:
            tokens[name] = part.get_tensor("input_ids"), part.get_tensor("loss_mask").astype(bool)
    candidates = []
    for number, entry in enumerate(entries):
        ids, mask = tokens[entry["part"]]
        span = slice(entry["offset"], entry["offset"] + entry["length"])
        digest = hashlib.sha256(ids[span].astype("<i4").tobytes()).hexdigest()
        candidates.append(Candidate(shard, number, entry, digest, ids[span][mask[span]]))
    return candidates


def select(candidates: list[Candidate], min_tokens: int, max_tokens: int) -> tuple[list[Candidate], dict[str, int]]:
    """Drop exact duplicates (the first occurrence stays) and samples outside the length limits."""
    kept, seen = [], set()
    dropped = {"duplicates": 0, "too_few_masked": 0, "too_long": 0}
    for candidate in candidates:
        if candidate.digest in seen:
            dropped["duplicates"] += 1
            continue
        seen.add(candidate.digest)
        if candidate.entry["masked"] < min_tokens:
            dropped["too_few_masked"] += 1
        elif candidate.entry["length"] > max_tokens:
            dropped["too_long"] += 1
        else:
            kept.append(candidate)
    return kept, dropped


def split(candidates: list[Candidate], seed: int, val_fraction: float) -> tuple[list[Candidate], list[Candidate]]:
    """Seeded shuffle of the prompts, then the first ``round(val_fraction·n)`` (at least 1 when > 0) are validation.

    A prompt's answers (``generate.samples``; ``prompt_group`` of their ids) stay together, in shard
    order, on one side: validation never scores an answer to a prompt that training saw. With one
    answer per prompt every group is one sample, and this is the shuffle of the samples themselves.
    """
    groups: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(prompt_group(candidate.entry["id"]), []).append(candidate)
    prompts = list(groups.values())
    if len(prompts) < 2:
        raise UserError(f"merge: {len(candidates)} sample(s) of {len(prompts)} prompt(s) left after filtering; need at "
                        "least 2 prompts (check merge.min_tokens/max_tokens)")
    order = np.random.default_rng(seed).permutation(len(prompts))
    shuffled = [prompts[i] for i in order]
    n_val = min(len(shuffled) - 1, max(1, round(val_fraction * len(shuffled)))) if val_fraction > 0 else 0
    return [c for group in shuffled[n_val:] for c in group], [c for group in shuffled[:n_val] for c in group]


def first_prompts(train: list[Candidate], prompts: int | None) -> list[Candidate]:
    """``merge.train_prompts``: the first ``prompts`` prompts of the shuffled train split (all: None), a prompt with all
    its answers. The subsets of one seed nest (each is a prefix of the next) and share the validation split, so
    drafters trained on them differ only in how much data they saw: a tau-against-data curve from one extraction."""
    if prompts is None:
        return train
    seen: set[str] = set()
    for index, candidate in enumerate(train):
        seen.add(prompt_group(candidate.entry["id"]))
        if len(seen) > prompts:
            return train[:index]
    return train


def sample_sources(generated: Path, shards: list[str]) -> dict[str, str]:
    """Each generated record's ``source`` (its prompt's), by record id: what ``merge.source_repeats`` weighs by."""
    return {record["id"]: record["source"] for shard in shards for record in read_jsonl(generated / shard / "records.jsonl")}


def repeated(train: list[Candidate], names: list[str | None], repeats: dict[str, float], seed: int) -> list[Candidate]:
    """``merge.source_repeats`` on the train split: each sample of a source repeated r times (``names``: each sample's
    source) kept floor(r) times, and once more where a seeded draw falls below r - floor(r); a source not named, once.
    The copies follow the samples (each epoch packs its own permutation of them all)."""
    draws = np.random.default_rng([seed, 1]).random(len(train))  # [seed, 1]: apart from the split's draws
    copies = []
    for candidate, name, draw in zip(train, names, draws):
        times = float(repeats.get(name, 1.0)) if name is not None else 1.0
        copies.append(int(times) + (draw < times - int(times)))
    return [c for c, n in zip(train, copies) if n] + [c for c, n in zip(train, copies) for _ in range(n - 1)]


def token_counts(candidates: list[Candidate], vocab_size: int) -> np.ndarray:
    """[V] int64: how often each token is a prediction target (under the loss mask)."""
    targets = np.concatenate([c.targets for c in candidates]) if candidates else np.zeros(0, np.int32)
    if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
        raise UserError(f"merge: token ids outside the verifier's vocabulary [0, {vocab_size}); the shards do not match models/verifier")
    return np.bincount(targets, minlength=vocab_size).astype(np.int64)


def draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(d2t int64 [Vd], t2d bool [V], filled): the Vd most frequent targets, sorted by id.

    Ties, and the fill when fewer than Vd distinct tokens were seen, go to the lower ids.
    Example: counts [0, 5, 0, 9, 5], Vd 3 -> targets [1, 3, 4] -> d2t [1, 2, 2], t2d [F, T, F, T, T].
    """
    vocab_size = len(counts)
    size = min(draft_vocab_size, vocab_size)
    by_frequency = np.lexsort((np.arange(vocab_size), -counts))  # most frequent first, then lower id
    targets = np.sort(by_frequency[:size])  # [Vd]
    d2t = targets - np.arange(size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[targets] = True
    filled = max(0, size - int((counts > 0).sum()))
    return d2t.astype(np.int64), t2d, filled


def coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    """Share of target tokens inside the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum() / total) if total else 0.0


def stored_bytes(root: Path, candidates: list[Candidate]) -> int:
    """Bytes of the listed shards' safetensors parts (hidden states and token ids): the disk a run needs."""
    return sum((root / shard / part).stat().st_size for shard, part in sorted({(c.shard, c.entry["part"]) for c in candidates}))


def length_histogram(candidates: list[Candidate]) -> list[dict[str, int]]:
    """Samples per power-of-two length bin: ``{"length": upper bound, "samples": n}`` for lengths ≤ bound."""
    lengths = np.array([c.entry["length"] for c in candidates])
    bounds = [2**k for k in range(4, max(5, int(np.ceil(np.log2(lengths.max()))) + 1))]
    counts = np.histogram(lengths, bins=[0.5] + [b + 0.5 for b in bounds])[0]  # bin i: (bound i-1, bound i]
    return [{"length": bound, "samples": int(n)} for bound, n in zip(bounds, counts)]


def merge(verifier: Path, root: Path, out: Path, metrics: Path, params: DictConfig, generated: Path | None = None) -> dict[str, Any]:
    """The whole stage; returns the statistics. ``generated``: the shards' generated records (their prompts'
    sources), read where ``merge.source_repeats`` weighs any source."""
    cfg, shards = params.merge, list(params.dataset.shards)
    identity = read_identity(verifier)  # identity.json, the dep: not meta.json, whose build differs by machine
    fingerprint = identity["id"]
    common = shard_meta(root, shards, fingerprint)
    candidates = [c for shard in shards for c in read_candidates(root, shard)]
    kept, dropped = select(candidates, int(cfg.min_tokens), int(cfg.max_tokens))
    train, val = split(kept, int(params.seed), float(cfg.val_fraction))
    train = first_prompts(train, cfg.train_prompts)
    unrepeated = len(train)
    if cfg.source_repeats:
        if generated is None:
            raise UserError("merge.source_repeats needs the generated records (--generated data/generated)")
        sources, specs = sample_sources(generated, shards), [spec for _, spec in configured_sources(params.dataset)]
        train = repeated(train, [source_of(sources[c.entry["id"]], specs) for c in train], to_plain(cfg.source_repeats), int(params.seed))
        if not train:
            raise UserError(f"params.yaml: merge.source_repeats = {to_plain(cfg.source_repeats)}: leaves no training "
                            "sample; give some source a repeat above 0")
    train_counts = token_counts(train, common["vocab_size"])
    d2t, t2d, filled = draft_vocab(train_counts, int(cfg.draft_vocab_size))
    stats = {
        "input_samples": len(candidates),
        "records": len(kept),
        "train_records": len(train),
        "val_records": len(val),
        "left_out_records": len(kept) - unrepeated - len(val),  # past merge.train_prompts
        "repeated_records": len(train) - unrepeated,  # merge.source_repeats' copies less its samples left out
        "tokens": int(sum(c.entry["length"] for c in kept)),
        "hidden_state_bytes": stored_bytes(root, candidates),
        "masked_tokens": int(sum(c.entry["masked"] for c in kept)),
        **{f"dropped_{reason}": n for reason, n in dropped.items()},
        "draft_vocab_size": len(d2t),
        "distinct_targets": int((train_counts > 0).sum()),
        "draft_vocab_filled": filled,
        "vocab_coverage": coverage(train_counts, t2d),
        "val_vocab_coverage": coverage(token_counts(val, common["vocab_size"]), t2d),
    }
    histogram = length_histogram(kept)
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "manifest.jsonl", manifest_rows(train, "train") + manifest_rows(val, "val"))
        save_vocab(tmp / "vocab.safetensors", d2t, t2d, fingerprint, filled)
        write_json(tmp / "meta.json", {
            "verifier": {"name": identity["name"], "fingerprint": fingerprint},
            **common,
            "shards": shards,
            "seed": int(params.seed),
            "params": to_plain(cfg),
            "stats": stats,
            "length_histogram": histogram,
        })
    log_metrics(metrics, stats, histogram)
    log.info("merge: %d samples (%d train rows, %+d by merge.source_repeats; %d val), vocab coverage %.4f", len(kept),
             len(train), stats["repeated_records"], len(val), stats["vocab_coverage"])
    return stats


def manifest_rows(candidates: list[Candidate], split_name: str) -> list[dict[str, Any]]:
    return [
        {"shard": c.shard, "index": c.index, "id": c.entry["id"], "part": c.entry["part"], "offset": c.entry["offset"],
         "length": c.entry["length"], "masked": c.entry["masked"], "split": split_name}
        for c in candidates
    ]


def save_vocab(path: Path, d2t: np.ndarray, t2d: np.ndarray, fingerprint: str, filled: int) -> None:
    from safetensors.numpy import save_file

    meta = {
        "draft_vocab_size": len(d2t),
        "vocab_size": len(t2d),
        "verifier_fingerprint": fingerprint,
        "filled": filled,
        "rule": "top-Vd loss-masked target tokens of the train split, ties and fill by lower id, sorted by id; target = draft + d2t[draft]",
    }
    # One metadata key: safetensors writes several in random order, and the bytes must be reproducible.
    save_file({"d2t": d2t, "t2d": t2d}, str(path), metadata={"eagle3": json.dumps(meta, sort_keys=True)})


def log_metrics(folder: Path, stats: dict[str, Any], histogram: list[dict[str, int]]) -> None:
    from dvclive import Live

    with Live(str(folder), dvcyaml=False, save_dvc_exp=False) as live:
        for name, value in stats.items():
            live.log_metric(name, value, plot=False)
        live.log_plot("length_histogram", histogram, x="samples", y="length")  # rendering is declared in dvc.yaml


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.merge", description="build the training mixture and the draft vocabulary")
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("hidden_states", type=Path, help="folder of the extracted shards, e.g. data/hidden_states")
    parser.add_argument("out", type=Path, help="output folder, e.g. data/merged")
    parser.add_argument("metrics", type=Path, help="dvclive folder for the statistics, e.g. metrics/merge")
    parser.add_argument("--generated", type=Path, help="folder of the generated shards, e.g. data/generated: their "
                        "sources, for merge.source_repeats")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    merge(args.verifier, args.hidden_states, args.out, args.metrics, stage_params(PARAMS, args.params), args.generated)
