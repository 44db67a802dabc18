"""A split's hidden states held in the training device's memory, its packed rows gathered there
(``train.states_on_device``).

    splits = on_device({"train": HiddenStates(merged, hidden_states, "train"), ...}, cfg, world)  # Resident, or as given
    batch = collate([splits["train"][i] for i in rows], batching)   # ``token``: where each row's tokens sit
    states = splits["train"].gather(batch["token"].to(device))      # {"aux", "final"}: the rows, on the device

Why: read from disk and handed over by DataLoader workers, an 8,192-token row of the 10k recipe
(37 MB) reached the GPU at about 60 rows a second, while the compiled step took 9.4 ms; the step
waited for its rows. Once on the device, a row is one gather. The samples are read (and checked)
once, at the start; token 0 of the device tensors is zeros, what padding points at. The
``train.num_workers`` workers still pack the rows (a few kilobytes of host tensors each): packed in
the training process, between steps, the host fell behind the GPU on some steps (one H100: median
12.6-16.3 ms, mean 22.6-30.0 ms; with 4 workers 13.1-13.4 / 13.2-13.6 ms, against 26.0-26.6 ms
read from disk by the same workers; ``benchmarks/results/train_step_resident.json``).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor
from torch.utils.data import Dataset
from tqdm import tqdm

from eagle3.training.config import TrainConfig
from eagle3.training.parallel import World

log = logging.getLogger(__name__)

# Of the device memory free before the states arrive, the share they may take under `auto`: the rest is
# the step's (activations of 8,192-token rows, the compiled step's workspace, the optimizer).
AUTO_SHARE = 0.5
# Each of the two host buffers the states go through (``Staging``): a copy of this size runs at the link's speed.
STAGING_BYTES = 256 << 20


class Resident(Dataset):
    """``dataset`` (items with ``input_ids``, ``loss_mask``, ``aux``, ``final``: ``HiddenStates``) with ``aux`` and
    ``final`` of every sample in two device tensors. Items keep ``input_ids`` and ``loss_mask`` on the host (what
    packing and the TTT selection read) and name their tokens' rows of the device tensors as ``token``."""

    def __init__(self, dataset: Dataset, device: torch.device, desc: str):
        self.lengths = dataset.lengths
        first = dataset[0]
        shape = (1 + sum(self.lengths),)  # token 0: the zero row padding gathers
        self.aux = torch.zeros(shape + first["aux"].shape[1:], dtype=first["aux"].dtype, device=device)
        self.final = torch.zeros(shape + first["final"].shape[1:], dtype=first["final"].dtype, device=device)
        self.host: list[tuple[Tensor, Tensor, int]] = []  # input_ids, loss_mask, first token
        with Staging((self.aux, self.final), max(self.lengths), first_row=1) as staging:
            for i in tqdm(range(len(dataset)), desc=desc, unit="sample", mininterval=5):
                sample = first if i == 0 else dataset[i]
                start = staging.put(sample["aux"], sample["final"])
                self.host.append((sample["input_ids"], sample["loss_mask"], start))

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        input_ids, loss_mask, start = self.host[i]
        return {"input_ids": input_ids, "loss_mask": loss_mask, "token": torch.arange(start, start + len(input_ids))}

    def __getstate__(self) -> dict:
        """What a DataLoader worker started by pickling (spawn) gets: the host side; its items never read the states."""
        return {**self.__dict__, "aux": None, "final": None}

    def gather(self, token: Tensor) -> dict[str, Tensor]:
        """The states of a collated ``token`` index [B, T] (on the device): ``aux`` [B, T, 3H], ``final`` [B, T, H]."""
        return {"aux": self.aux[token], "final": self.final[token]}


class Staging:
    """Device tensors filled row after row, from ``first_row`` on, through two host buffers: one is sent whole,
    asynchronously, while the next samples are read into the other (pinned on CUDA). Why: sent sample by sample from
    pageable memory, each copy waiting for the last, the 10k run's 13.6 GB of states reached an H100 at 3 GB/s (4.5 s;
    3.8 s in its repeat). Through these buffers, on another H100: 5.0 s, 3.0 s in the repeat; no clear gain yet, so
    reading the shards, not the copy, may set that pace.

        with Staging((aux, final), longest_sample, first_row=1) as staging:
            start = staging.put(sample_aux, sample_final)    # the rows they go to: start, start + 1, ...
    """

    def __init__(self, targets: tuple[Tensor, ...], min_rows: int, first_row: int = 0):
        self.targets = targets
        row_bytes = sum(t[0].numel() * t.element_size() for t in targets)
        rows = max(min_rows, STAGING_BYTES // row_bytes)
        self.cuda = targets[0].device.type == "cuda"
        self.buffers = [[torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda) for t in targets] for _ in range(2)]
        self.sent: list = [None, None]  # each buffer's last copy (a CUDA event): refilled only once it is done
        self.current, self.start, self.filled = 0, first_row, 0  # the current buffer holds rows start .. start + filled

    def put(self, *rows: Tensor) -> int:
        """Queue one sample's rows (one tensor a target); returns the first row they go to."""
        n = len(rows[0])
        if self.filled + n > len(self.buffers[0][0]):
            self.flush()
        for buffer, values in zip(self.buffers[self.current], rows):
            buffer[self.filled : self.filled + n] = values
        self.filled += n
        return self.start + self.filled - n

    def flush(self) -> None:
        """Send the current buffer, then wait until the other one's copy is done before it is refilled."""
        for target, buffer in zip(self.targets, self.buffers[self.current]):
            target[self.start : self.start + self.filled].copy_(buffer[: self.filled], non_blocking=True)
        if self.cuda:
            self.sent[self.current] = torch.cuda.Event()
            self.sent[self.current].record()
        self.current, self.start, self.filled = 1 - self.current, self.start + self.filled, 0
        if self.sent[self.current] is not None:
            self.sent[self.current].synchronize()

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, *exc) -> None:
        if self.filled:
            self.flush()
        if self.cuda:
            torch.cuda.current_stream(self.targets[0].device).synchronize()  # the buffers outlive no copy of theirs


def state_bytes(dataset: Dataset) -> int:
    """Bytes of ``dataset``'s ``aux`` and ``final`` as training reads them (its first sample's widths and dtypes)."""
    first = dataset[0]
    per_token = sum(first[k].shape[1] * first[k].element_size() for k in ("aux", "final"))
    return (1 + sum(dataset.lengths)) * per_token


def on_device(splits: dict[str, Dataset], cfg: TrainConfig, world: World) -> dict[str, Dataset]:
    """The splits as training reads them: ``Resident`` when ``train.states_on_device`` says so (auto: on CUDA when
    every split's states fit in ``AUTO_SHARE`` of the free memory), else as given (the states read by the workers too)."""
    wanted = cfg.states_on_device
    if wanted == "auto":
        if world.device.type != "cuda":
            return splits
        needed, free = sum(state_bytes(s) for s in splits.values()), torch.cuda.mem_get_info(world.device)[0]
        wanted = needed <= AUTO_SHARE * free
        if world.main:
            log.info("train.states_on_device auto: the states take %.1f GB, %s %.0f%% of the %.1f GB free: %s", needed / 1e9,
                     "within" if wanted else "more than", AUTO_SHARE * 100, free / 1e9,
                     "held on the device" if wanted else "read from disk by train.num_workers workers")
    if not wanted:
        return splits
    start = time.perf_counter()
    resident = {name: Resident(s, world.device, f"{name} states to {world.device.type}") for name, s in splits.items()}
    if world.main:
        log.info("the states on %s in %.1f s", world.device, time.perf_counter() - start)
    return resident
