"""The PyTorch dataset over the merge manifest, which ``train`` reads through.

    dataset = HiddenStates("data/merged", "data/hidden_states", "train")
    dataset[i]                                                   # one sample's tensors, checked
    check_recorded_digests(hidden_states, shards, digests)       # every shard file as extract wrote it

How training packs and orders the samples is ``eagle3.training.data``.

Samples are token ranges of safetensors parts (format: ``eagle3.hidden_states.storage``), referenced by
``data/merged/manifest.jsonl``. Parts are memory-mapped with ``safetensors.safe_open`` and only
the requested rows are read. Every sample read is checked against its shard's index (shapes,
token ids within the vocabulary, masked count, finite values within the magnitudes recorded at
extraction): a corrupted part stops training with the file and sample named instead of being
trained on. Before training, ``check_recorded_digests`` compares every shard file with the sha256
extract recorded, which also catches a value changed within the recorded magnitudes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from eagle3.common import UserError, read_json, read_jsonl
from eagle3.hidden_states.storage import load_problem, read_rows, training_states
from eagle3.lm.spec import require_verifier


class HiddenStates(Dataset):
    """One split of the merge manifest; items are tensors ready for training.

    Item: ``input_ids`` [T] int64, ``loss_mask`` [T] bool (1 = a token of the answer the drafter
    must predict, unshifted), ``aux`` [T, 3H] (ascending tapped layers), ``final`` [T, H] (post-norm:
    ``lm_head(final)`` are the verifier's logits); the states in bfloat16 as stored, float32 where
    fp8 storage is decoded (``storage.training_states``).
    """

    def __init__(self, merged: str | Path, hidden_states: str | Path, split: str):
        merged, self.root = Path(merged), Path(hidden_states)
        self.meta = read_json(merged / "meta.json")
        self.rows = [row for row in read_jsonl(merged / "manifest.jsonl") if row["split"] == split]
        if not self.rows:
            raise UserError(f"{merged}/manifest.jsonl: no samples in split {split!r}")
        self.widths = {"aux": len(self.meta["aux_layers"]) * self.meta["hidden_size"], "final": self.meta["hidden_size"]}
        self.vocab_size = self.meta["vocab_size"]  # the verifier's: token ids beyond it are damage
        self.index = {}  # shard -> its index.jsonl entries, what each read is checked against
        for shard in sorted({row["shard"] for row in self.rows}):
            self._check_shard(shard)
            self.index[shard] = list(read_jsonl(self.root / shard / "index.jsonl"))
        self._parts: dict[tuple[str, str], object] = {}  # opened lazily, per DataLoader worker

    def _check(self, row: dict, sample: dict[str, torch.Tensor]) -> None:
        """Refuse rows that are not what extract stored (a corrupted or replaced part)."""
        entries = self.index[row["shard"]]
        entry = entries[row["index"]] if 0 <= row["index"] < len(entries) else {}
        where = self.root / row["shard"] / row["part"]
        if any(entry.get(key) != row[key] for key in ("id", "part", "offset", "length", "masked")):
            raise UserError(f"{self.root / row['shard']}/index.jsonl: line {row['index'] + 1} is not sample {row['id']} of the "
                            "merged manifest; re-run `dvc repro` (merge)")
        problem = load_problem(entry, sample, self.widths, self.vocab_size)
        if problem:
            raise UserError(f"{where}: sample {row['id']} (tokens {row['offset']}..{row['offset'] + row['length']}): {problem}; "
                            f"the file is damaged: restore it (`dvc checkout {self.root / row['shard']}`) or re-run extract")

    def _check_shard(self, shard: str) -> None:
        shard_meta = read_json(self.root / shard / "meta.json")
        require_verifier(f"{self.root / shard}/meta.json", "extracted with", shard_meta["verifier"]["fingerprint"],
                         self.meta["verifier"]["fingerprint"], "the merged manifest's is")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Tokens of each sample, from the manifest (nothing is read)."""
        return [row["length"] for row in self.rows]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_parts": {}}  # memory maps are not sent to worker processes

    def _part(self, shard: str, part: str):
        from safetensors import safe_open

        key = (shard, part)
        if key not in self._parts:
            self._parts[key] = safe_open(self.root / shard / part, framework="pt")
        return self._parts[key]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        names = ["input_ids", "loss_mask", "aux", "aux_scale", "final", "final_scale"]
        stored = read_rows(self._part(row["shard"], row["part"]), names, row["offset"], row["offset"] + row["length"])
        sample = {
            "input_ids": stored["input_ids"].long(),
            "loss_mask": stored["loss_mask"].bool(),
            "aux": training_states(stored, "aux"),
            "final": training_states(stored, "final"),
        }
        self._check(row, sample)
        return sample


def check_recorded_digests(hidden_states: Path, shards: list[str], digests: dict[str, str]) -> None:
    """Refuse a shard file whose content is not what extract wrote (the ``sha256`` of its meta.json).

    ``digests``: the sha256 of the files training reads, named ``hidden_states/<shard>/<file>`` as
    ``eagle3.training.checkpoints.training_inputs`` names them (it hashes every input once for the run id; nothing is
    hashed again here). Catches damage that the per-sample checks cannot: a value changed to
    another one within the magnitudes recorded at extraction.
    """
    for shard in shards:
        folder = hidden_states / shard
        recorded = read_json(folder / "meta.json").get("sha256")
        if recorded is None:
            raise UserError(f"{folder}/meta.json records no sha256 of its files (extracted by an older eagle3); "
                            f"re-extract it: `dvc repro -f extract@{shard}`")
        for name, expected in sorted(recorded.items()):
            found = digests.get(f"hidden_states/{shard}/{name}")
            if found != expected:
                state = "is missing" if found is None else f"has sha256 {found[:12]}, not the {expected[:12]} extract recorded"
                raise UserError(f"{folder}/{name} {state}: the shard was damaged after extraction; {mend(folder / name, shard)}")


def mend(file: Path, shard: str) -> str:
    """What restores a damaged hidden-state file: ``dvc checkout`` from the cache, unless the cache object is the file
    itself (hard-linked, and written through: as root a write ignores the cache's read-only mode)."""
    folder = file.parent
    twin = cache_twin(file) if file.is_file() else None
    if twin is None:
        return f"re-extract it (`dvc repro -f extract@{shard}`) or restore it (`dvc checkout --force {folder}`)"
    return (f"its DVC cache object {twin} is the same file (hard-linked; as root a write ignores the cache's read-only "
            f"mode), damaged too, so `dvc checkout` cannot restore it: remove both (`rm -f {file} {twin}`), then re-extract "
            f"(`dvc repro -f extract@{shard}`) or pull a copy pushed before the damage (`dvc pull --force {folder}`)")


def cache_twin(file: Path) -> Path | None:
    """The object of the DVC cache (``.dvc/cache`` of the repository holding ``file``) that is ``file`` itself, or None."""
    if file.stat().st_nlink < 2:
        return None
    root = next((parent for parent in file.resolve().parents if (parent / ".dvc").is_dir()), None)
    objects = sorted((root / ".dvc" / "cache" / "files" / "md5").glob("*/*")) if root else []
    twin = next((path for path in objects if path.samefile(file)), None)
    return Path(os.path.relpath(twin)) if twin else None
