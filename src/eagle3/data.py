"""The PyTorch dataset and loader over the merge manifest, which ``train`` reads through.

    from eagle3.data import make_loader
    loader = make_loader("data/merged", "data/hidden_states", "train", batch_size=4)

Samples are token ranges of safetensors parts (format: ``eagle3.storage``), referenced by
``data/merged/manifest.jsonl``. Parts are memory-mapped with ``safetensors.safe_open`` and only
the requested rows are read. Every sample read is checked against its shard's index (shapes,
masked count, finite values within the magnitudes recorded at extraction): a corrupted part stops
training with the file and sample named instead of being trained on.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from eagle3.common import UserError, read_json, read_jsonl
from eagle3.storage import decode_states, load_problem, read_rows


class HiddenStates(Dataset):
    """One split of the merge manifest; items are float32 tensors ready for training.

    Item: ``input_ids`` [T] int64, ``loss_mask`` [T] bool (1 = a token of the answer the drafter
    must predict, unshifted), ``aux`` [T, 3H] float32 (ascending tapped layers), ``final`` [T, H]
    float32 (post-norm: ``lm_head(final)`` are the verifier's logits).
    """

    def __init__(self, merged: str | Path, hidden_states: str | Path, split: str):
        merged, self.root = Path(merged), Path(hidden_states)
        self.meta = read_json(merged / "meta.json")
        self.rows = [row for row in read_jsonl(merged / "manifest.jsonl") if row["split"] == split]
        if not self.rows:
            raise UserError(f"{merged}/manifest.jsonl: no samples in split {split!r}")
        self.widths = {"aux": len(self.meta["aux_layers"]) * self.meta["hidden_size"], "final": self.meta["hidden_size"]}
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
        problem = load_problem(entry, sample, self.widths)
        if problem:
            raise UserError(f"{where}: sample {row['id']} (tokens {row['offset']}..{row['offset'] + row['length']}): {problem}; "
                            f"the file is damaged: restore it (`dvc checkout {self.root / row['shard']}`) or re-run extract")

    def _check_shard(self, shard: str) -> None:
        shard_meta = read_json(self.root / shard / "meta.json")
        expected = self.meta["verifier"]["fingerprint"]
        if shard_meta["verifier"]["fingerprint"] != expected:
            raise UserError(
                f"{self.root / shard}/meta.json: verifier {shard_meta['verifier']['fingerprint']} != {expected} "
                "of the merged manifest; re-run `dvc repro`"
            )

    def __len__(self) -> int:
        return len(self.rows)

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
            "aux": decode_states(stored, "aux"),
            "final": decode_states(stored, "final"),
        }
        self._check(row, sample)
        return sample


def collate(items: list[dict[str, torch.Tensor]], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of items to the longest: every [T, ...] becomes [B, T_max, ...].

    Adds ``attention_mask`` [B, T_max] bool (True on real tokens) and ``lengths`` [B] int64.
    Padded positions have ``loss_mask`` False and zero hidden states.
    """
    from torch.nn.utils.rnn import pad_sequence

    lengths = torch.tensor([len(item["input_ids"]) for item in items])
    batch = {
        key: pad_sequence([item[key] for item in items], batch_first=True, padding_value=pad_token_id if key == "input_ids" else 0)
        for key in ("input_ids", "loss_mask", "aux", "final")
    }
    batch["attention_mask"] = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # [B, T_max]
    batch["lengths"] = lengths
    return batch


def make_loader(
    merged: str | Path,
    hidden_states: str | Path,
    split: str,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    pad_token_id: int = 0,
) -> DataLoader:
    """A DataLoader over one split of the merge manifest, reshuffled each epoch from ``seed``."""
    dataset = HiddenStates(merged, hidden_states, split)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=num_workers,
        collate_fn=partial(collate, pad_token_id=pad_token_id),
    )
