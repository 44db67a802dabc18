"""The on-disk format of hidden states, shared by ``extract`` (writes) and ``data`` (reads).

A shard folder holds safetensors parts; each part is the concatenation of many samples along
the token axis:

    input_ids [N] int32, loss_mask [N] uint8,
    aux [N, 3H] and final [N, H] in bf16, or in float8_e4m3fn with
    aux_scale [N, 3] and final_scale [N, 1] float32 (one scale per token and per tapped layer).

A sample is the token range ``[offset, offset + length)`` of one part. Its index entry records
``max_abs``, the largest |value| of its decoded ``aux`` and ``final``: the loader checks every
sample it reads against its entry (``load_problem``), so a corrupted part is refused, not trained
on. The shard's meta.json records the sha256 of every other file of the shard (``sha256``), which
train compares before training: damage within the recorded magnitudes is refused too. ``PartWriter`` writes the parts and the index entries; ``read_rows`` reads a sample back. This module is a dependency of every ``extract`` stage (a change here re-extracts) and of
``train``, which reads it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import shutil
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3.common import Spent, UserError
from eagle3.hidden_states.config import STORAGE_DTYPES

FP8_MAX = 448.0  # largest finite float8_e4m3fn value
# Parts written at once by extract's background threads: the writes (concatenation, file I/O, sha256) run outside the
# interpreter lock, so threads add up: on an H100 host one wrote 307 MB/s of parts and four 960 MB/s
# (benchmarks/results/part_writer_h100.json), where a 10k extract shard stored 192-227 MB/s with one or four: the
# capture loop, not the writers, sets that pace (extract logs its parts). Host memory: about PART_WRITERS + 1 parts.
PART_WRITERS = 4


def bytes_per_token(hidden_size: int, groups: int, dtype: str) -> int:
    """Stored bytes per token: aux (groups·H) + final (H) + input_ids (int32) + loss_mask (uint8) [+ fp8 scales]."""
    element = 2 if dtype == "bfloat16" else 1
    scales = 4 * (groups + 1) if dtype == "float8_e4m3fn" else 0
    return (groups + 1) * hidden_size * element + scales + 4 + 1


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, G*H] -> (fp8 [T, G*H], scale [T, G] float32): one scale per token and per group.

    A group is one tapped layer's H values, so a layer with large activations does not cost the
    others their precision. ``x ≈ q * scale`` with a relative error ≤ 2^-4 plus scale·2^-10.
    """
    tokens, width = x.shape
    grouped = x.float().reshape(tokens, groups, width // groups)  # [T, G, H]
    scale = grouped.abs().amax(dim=-1) / FP8_MAX  # [T, G]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero rows: any scale works
    q = (grouped / scale[..., None]).to(torch.float8_e4m3fn).reshape(tokens, width)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(fp8 [T, G*H], scale [T, G]) -> float32 [T, G*H]."""
    tokens, width = q.shape
    grouped = q.float().reshape(tokens, scale.shape[1], width // scale.shape[1])  # [T, G, H]
    return (grouped * scale[..., None]).reshape(tokens, width)


def encode_states(name: str, x: torch.Tensor, dtype: str, groups: int) -> dict[str, torch.Tensor]:
    """The stored tensors of hidden states ``x`` [T, G*H]: ``{name}`` and, for fp8, ``{name}_scale``."""
    if dtype == "bfloat16":
        return {name: x.to(torch.bfloat16).contiguous()}
    if dtype == "float8_e4m3fn":
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}
    raise UserError(f"params.yaml: extract.dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")


def decode_states(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """Inverse of ``encode_states``: float32 [T, G*H]."""
    scale = stored.get(f"{name}_scale")
    return stored[name].float() if scale is None else dequantize_fp8(stored[name], scale)


def training_states(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The states as training reads them: bfloat16 storage as stored, [T, G*H] (its float32 decoding
    exactly, in half the bytes: on a GPU, the loader's copies, pinning and transfer of 8,192-token rows
    set the train stage's pace); fp8 storage decoded (``decode_states``, float32)."""
    return stored[name] if f"{name}_scale" not in stored else decode_states(stored, name)


def load_problem(entry: dict, sample: dict[str, torch.Tensor], widths: dict[str, int], vocab_size: int) -> str | None:
    """Why a sample read for index ``entry`` is not what extract stored, or None.

    ``sample``: its ``input_ids``, ``loss_mask`` and ``aux``/``final`` (``training_states``);
    ``widths``: the expected width of ``aux`` (G*H) and ``final`` (H). Checks shapes, token ids
    within the verifier's ``vocab_size`` (an embedding lookup would fail steps later), the
    masked-token count, and that the states are finite and within the magnitudes recorded at
    extraction (the same decoding, so an intact sample meets its record exactly).
    """
    length = entry["length"]
    expected = {"input_ids": (length,), "loss_mask": (length,), "aux": (length, widths["aux"]), "final": (length, widths["final"])}
    for name, shape in expected.items():
        if tuple(sample[name].shape) != shape:
            return f"{name} has shape {tuple(sample[name].shape)}, the index says {shape}"
    ids = sample["input_ids"]
    if length and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        return f"input_ids holds token id {bad}, outside the verifier's vocabulary [0, {vocab_size})"
    if int(sample["loss_mask"].sum()) != entry["masked"]:
        return f"{int(sample['loss_mask'].sum())} masked tokens, the index says {entry['masked']}"
    if "max_abs" not in entry:
        return "the index records no max_abs (extracted by an older eagle3); re-run extract"
    for name in ("aux", "final"):
        low, high = (float(x) for x in torch.aminmax(sample[name]))  # no |x| copy of the sample; NaN wins
        value = high if math.isnan(high) or abs(high) >= abs(low) else low  # the value of largest magnitude, sign kept
        if not math.isfinite(value):
            return f"{name} holds {value} (not finite)"
        if abs(value) > entry["max_abs"][name]:
            return f"{name} holds {value:.3g}, beyond the max |value| {entry['max_abs'][name]:.3g} recorded at extraction"
    return None


def read_rows(part, names: list[str], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows ``[start, stop)`` of the named tensors of an open part (only those bytes are read)."""
    keys = set(part.keys())
    return {key: part.get_slice(key)[start:stop] for key in names if key in keys}


# --- writing a shard (extract) ---------------------------------------------------------------------


class PartWriter:
    """Concatenates samples into safetensors parts of about ``part_bytes`` and indexes them.

    A sample (``eagle3.hidden_states.samples.Sample``) brings ``id``, ``record`` (its line in records.jsonl, unique
    in the shard), ``input_ids``, ``loss_mask`` and ``truncated``; its index entry is built here.

    Parts are written by ``writers`` background threads while the verifier runs the next batches (at 8B one
    thread's writes took as long as the forward). At most ``writers`` parts are being written while the next
    fills, so host memory stays at about ``writers`` + 1 parts. Use it as a context manager: leaving without
    an error writes the rest and waits for it (raising a failed write's error); with one, it only waits.
    """

    def __init__(self, folder: Path | None, part_bytes: int, writers: int = PART_WRITERS, spent: Spent | None = None):
        self.folder, self.part_bytes, self.writers = folder, part_bytes, writers
        self.spent = spent or Spent()  # its "waiting for part writers"
        self.pending: list[tuple[Any, dict[str, torch.Tensor], dict[str, float]]] = []
        self.pending_bytes = 0
        self.index: list[dict[str, Any]] = []
        self.sha256: dict[str, str] = {}  # part -> sha256 of its file, as written, in the parts' order
        self.background = ThreadPoolExecutor(writers, thread_name_prefix="part-writer")
        self.writing: deque[tuple[str, Future]] = deque()  # the parts being written, oldest first

    def add(self, sample: Any, stored: dict[str, torch.Tensor], largest: dict[str, float]) -> None:
        self.pending.append((sample, stored, largest))
        self.pending_bytes += sum(t.nbytes for t in stored.values())
        if self.pending_bytes >= self.part_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        name = f"part-{min(s.record for s, _, _ in self.pending):06d}.safetensors"  # records are unique across parts
        offset = 0
        for sample, _, largest in self.pending:
            length = len(sample.input_ids)
            self.index.append(
                {"id": sample.id, "record": sample.record, "part": name, "offset": offset, "length": length,
                 "masked": sum(sample.loss_mask), "truncated": sample.truncated, "max_abs": largest}
            )
            offset += length
        while len(self.writing) >= self.writers:
            self.collect_oldest()
        if self.folder is not None:  # None: the ranks of a sharded verifier other than rank 0 write nothing
            part = [stored for _, stored, _ in self.pending]
            self.writing.append((name, self.background.submit(write_part, self.folder / name, part)))
        self.pending, self.pending_bytes = [], 0

    def collect_oldest(self) -> None:
        name, written = self.writing.popleft()
        with self.spent.on("waiting for part writers"):
            self.sha256[name] = written.result()  # re-raises a failed write here, in the extracting thread

    def wait(self) -> None:
        while self.writing:
            self.collect_oldest()

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, error_type, *_) -> None:
        try:
            if error_type is None:
                self.flush()
                self.wait()
        finally:
            self.background.shutdown()


# safetensors' names of the stored dtypes, in the order its writer lays a file's tensors out (its dtype order,
# descending; then the name): ``write_part`` writes the same bytes as ``safetensors.torch.save_file``.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3",
                      torch.uint8: "U8"}


def write_part(path: Path, samples: list[dict[str, torch.Tensor]]) -> str:
    """One safetensors part: each key's tensors of all ``samples`` concatenated along tokens; returns the file's sha256.

    The bytes are those of ``safetensors.torch.save_file`` of the concatenated tensors (tested), written key by key:
    save_file copies each concatenated tensor again into a Python bytes object, and the file was then read back for
    its sha256; here each key's concatenation is written and hashed from where it lies (``benchmarks/part_writer.py``
    times the two: docs/benchmarks.md, "extract's part writer"). Concatenated, not written sample by sample: each
    write and hash lets go of the interpreter lock and must take it back, and beside a busy main thread a part's
    thousands of small ones were far slower than the few large ones (tried once while writing this; not recorded).

    A full disk is bad environment, not a bug: one line with the file, the bytes and what to do
    (the caller's ``atomic_dir`` removes the partial output).
    """
    order = list(SAFETENSORS_DTYPES.values())
    keys = sorted(samples[0], key=lambda key: (order.index(SAFETENSORS_DTYPES[samples[0][key].dtype]), key))
    header, offset = {}, 0
    for key in keys:
        nbytes = sum(stored[key].nbytes for stored in samples)
        rows = sum(stored[key].shape[0] for stored in samples)
        header[key] = {"dtype": SAFETENSORS_DTYPES[samples[0][key].dtype], "shape": [rows, *samples[0][key].shape[1:]],
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    try:
        with open(path, "wb") as f:
            for chunk in (struct.pack("<Q", len(text)), text):
                f.write(chunk)
                digest.update(chunk)
            for key in keys:
                data = memoryview(torch.cat([stored[key] for stored in samples]).view(torch.uint8).numpy()).cast("B")
                f.write(data)
                digest.update(data)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(path.parent).free
        raise UserError(f"{path}: no space left on the device writing this part of {size(offset)} ({size(free)} free now); "
                        "free space (or store less: extract.dtype=float8_e4m3fn halves it), then re-run extract; "
                        "nothing of this shard was kept") from None
    return digest.hexdigest()


def size(n: int) -> str:
    """Bytes in GB, or in MB below 0.01 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 10**7 else f"{n / 1e6:.2f} MB"
