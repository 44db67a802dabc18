"""The packing of samples into fixed-size rows and the order in which training takes them.

    batching = Batching(pack_tokens=2048, batch_size=2, grad_accum=1)   # how rows make a step (training.config)
    rows = pack(dataset.lengths, capacity=2048)                  # sample indices of each row
    batch = collate([dataset[i] for i in rows[0] + rows[1]], batching)   # [2, 2048, ...]
    plan = DataPlan(dataset.lengths, batching, seed=0)           # which samples each step takes
    batches = step_batches(dataset, plan, range(start, stop), collate_fn)   # the micro-batches of those steps
    InOrder(dataset.lengths, batching).micro_batches(0)          # validation: every sample once, in order

``dataset`` is ``eagle3.hidden_states.loader.HiddenStates`` (or anything with ``lengths`` and items
of its shapes): the data order is a pure function of (seed, step), so resuming needs only the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from eagle3.common import UserError
from eagle3.training.config import Batching


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Next-fit packing: consecutive items fill a row of ``capacity`` tokens until the next one
    does not fit, which starts a new row. Returns the item indices of each row, in order.

    Worked example: lengths [5, 3, 4, 2, 7], capacity 8 -> [[0, 1], [2, 3], [4]].
    Next-fit keeps the given order (the data order stays a function of seed and step) and is
    local, so packing the items of a few consecutive rows again gives the same rows.
    """
    rows: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"a sample of {n} tokens does not fit in a row of {capacity}")
        if used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def collate(items: list[dict[str, torch.Tensor]], batching: Batching) -> dict[str, torch.Tensor]:
    """Pack the items of one micro-batch (in order, ``pack``) into its ``batch_size`` rows of
    ``pack_tokens`` tokens: [batch_size, pack_tokens, ...].

    Every key of the items is packed (``input_ids``, ``loss_mask``, and ``aux`` and ``final``, or the ``token``
    index of ``training.resident``). Adds ``position_ids`` [batch_size, pack_tokens] int64: 0, 1, ... within each
    sample, restarting at the next; the padding tail of a row (zero states, token 0, loss_mask False) continues as one more
    sequence 0, 1, ... Rows beyond what the items fill are all padding. ``tokens``: real tokens.

    Worked example (pack_tokens 4, batch_size 2, samples of 2 and 1 tokens): position_ids
    [[0, 1, 0, 0], [0, 1, 2, 3]]; the first row holds both samples and one padding token.
    """
    capacity, rows = batching.pack_tokens, batching.batch_size
    lengths = [len(item["input_ids"]) for item in items]
    layout = pack(lengths, capacity)
    if len(layout) > rows:
        raise ValueError(f"{len(items)} samples need {len(layout)} rows of {capacity} tokens, not {rows}")
    first = items[0]
    batch = {key: batch_tensor(value, (rows, capacity, *value.shape[1:])) for key, value in first.items()}
    position_ids = batch_tensor(torch.arange(0), (rows, capacity))
    position_ids[:] = torch.arange(capacity)  # empty rows are one padding sequence
    for r, members in enumerate(layout):
        start = 0
        for i in members:
            n = lengths[i]
            for key in batch:
                batch[key][r, start : start + n] = items[i][key]
            position_ids[r, start : start + n] = torch.arange(n)
            start += n
        for key in batch:
            batch[key][r, start:] = 0
        position_ids[r, start:] = torch.arange(capacity - start)
    for key in batch:
        batch[key][len(layout) :] = 0
    return {**batch, "position_ids": position_ids, "tokens": sum(lengths)}


def batch_tensor(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised tensor of ``like``'s dtype, in shared memory inside a DataLoader worker. Why: a worker
    hands its batch to the training process through shared memory, and a batch made in private memory is
    copied there when it is sent (37 MB a row at the 10k shape: as long as reading and packing the row)."""
    if get_worker_info() is None:
        return like.new_empty(shape)
    storage = like.untyped_storage()._new_shared(math.prod(shape) * like.element_size())
    return torch.empty(0, dtype=like.dtype).set_(storage).view(shape)


# ---------------------------------------------------------------------------------------------
# Data order: a pure function of (seed, step), so resuming needs only the step.


class DataPlan:
    """Which samples each optimizer step trains on, packed into rows of ``pack_tokens`` tokens.

    Epoch e packs its permutation (seeded by seed and e) into rows (``pack``); its steps take
    G = batch_size x grad_accum x processes rows each, in order, dropping the tail rows of fewer
    than G. A step's rows are cut into processes x grad_accum micro-batches of batch_size rows;
    process r takes micro-batches r*grad_accum ... . A micro-batch is given as the sample indices
    of its rows in order: collating packs them into the same rows again.

    Worked example: lengths [3, 3, 2, 6, 1], pack_tokens 6, batch_size 1, grad_accum 1, 2 processes:
    a permutation [4, 0, 3, 1, 2] packs into rows [[4, 0], [3], [1, 2]]; G = 2, so the epoch has
    one step: process 0 trains on [4, 0], process 1 on [3]; row [1, 2] waits for the next epoch.
    """

    def __init__(self, lengths: list[int], batching: Batching, seed: int, rank: int = 0, processes: int = 1):
        self.lengths, self.batching, self.seed, self.rank = lengths, batching, seed, rank
        self.global_rows = batching.batch_size * batching.grad_accum * processes
        self.counts: list[int] = []  # steps of epochs 0, 1, ...
        self.packed: tuple[int, list[list[int]]] = (-1, [])  # the last epoch packed, and its rows

    def rows(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s packed rows (sample indices)."""
        if self.packed[0] != epoch:
            order = torch.randperm(len(self.lengths), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()
            self.packed = (epoch, [[order[i] for i in row] for row in pack([self.lengths[i] for i in order], self.batching.pack_tokens)])
        return self.packed[1]

    def steps_in(self, epoch: int) -> int:
        while len(self.counts) <= epoch:
            rows = len(self.rows(len(self.counts)))
            if rows < self.global_rows:
                raise UserError(f"train split: {rows} rows of train.pack_tokens {self.batching.pack_tokens} tokens, fewer than one "
                                f"global batch of {self.global_rows} rows (train.batch_tokens / train.pack_tokens); "
                                "lower train.batch_tokens")
            self.counts.append(rows // self.global_rows)
        return self.counts[epoch]

    def steps(self, epochs: int) -> int:
        """Optimizer steps of the first ``epochs`` epochs."""
        return sum(self.steps_in(e) for e in range(epochs))

    def micro_batches(self, step: int) -> list[list[int]]:
        """This process's ``grad_accum`` micro-batches of optimizer step ``step`` (sample indices)."""
        epoch = 0
        while step >= self.steps_in(epoch):
            step -= self.steps_in(epoch)
            epoch += 1
        size, accum = self.batching.batch_size, self.batching.grad_accum
        rows = self.rows(epoch)[step * self.global_rows : (step + 1) * self.global_rows]
        mine = rows[self.rank * accum * size :][: accum * size]
        return [sum(mine[i : i + size], []) for i in range(0, len(mine), size)]

    def tokens(self, steps: int) -> int:
        """Tokens (padding excluded) of all samples of optimizer steps 0 .. steps-1, over all processes.

        A function of the data order, not a running count, so a resumed run reports the same
        number; the same on every rank (each step takes the G rows of its epoch).
        """
        total, step, epoch = 0, 0, 0
        while step < steps:
            taken = min(self.steps_in(epoch), steps - step)
            total += sum(self.lengths[i] for row in self.rows(epoch)[: taken * self.global_rows] for i in row)
            step, epoch = step + taken, epoch + 1
        return total


class InOrder(DataPlan):
    """Every sample once, in index order, cut into steps as ``DataPlan`` cuts them, the last step
    taking the rows that are left (validation: every sample is scored, none is repeated).

    Worked example: lengths [3, 3, 2, 6, 1], pack_tokens 6, batch_size 1, grad_accum 1, 3
    processes: rows [[0, 1], [2], [3], [4]], G = 3, so two steps: step 0 gives processes 0, 1, 2
    [0, 1], [2] and [3]; step 1 gives process 0 [4] and processes 1 and 2 nothing.
    """

    def __init__(self, lengths: list[int], batching: Batching, rank: int = 0, processes: int = 1):
        super().__init__(lengths, batching, seed=0, rank=rank, processes=processes)  # the seed orders nothing here
        self.packed = (0, pack(lengths, batching.pack_tokens))

    def rows(self, epoch: int) -> list[list[int]]:
        return self.packed[1]

    def steps_in(self, epoch: int) -> int:
        return math.ceil(len(self.packed[1]) / self.global_rows)


def check_lengths(splits: dict[str, Dataset], batching: Batching) -> None:
    """Every sample must fit in one packed row."""
    for name, dataset in splits.items():
        longest = max(dataset.lengths)
        if longest > batching.pack_tokens:
            raise UserError(f"{name} split: a sample of {longest} tokens is longer than train.pack_tokens {batching.pack_tokens}; "
                            "raise train.pack_tokens (or lower merge.max_tokens)")


class StepSampler(Sampler):
    """Batch sampler: this process's micro-batches of the optimizer steps ``steps``, in order."""

    def __init__(self, plan: DataPlan, steps: range):
        self.plan, self.steps = plan, steps

    def __iter__(self):
        for step in self.steps:
            yield from self.plan.micro_batches(step)

    def __len__(self) -> int:
        return len(self.steps) * self.plan.batching.grad_accum


class ValidationSampler(Sampler):
    """Batch sampler of validation: each step's rows of this process (``InOrder``) in one micro-batch; sample 0
    where the last step leaves a process without rows (computed, not counted: every process runs as many forwards)."""

    def __init__(self, plan: InOrder):
        self.plan = plan

    def __iter__(self):
        for step in range(len(self)):
            yield sum(self.plan.micro_batches(step), []) or [0]

    def __len__(self) -> int:
        return self.plan.steps(1)

    def counted(self, step: int) -> bool:
        """Whether step ``step``'s micro-batch holds rows of this process (else it is sample 0, not counted)."""
        return bool(self.plan.micro_batches(step))


def step_batches(dataset: Dataset, plan: DataPlan, steps: range, collate_fn: Callable, num_workers: int = 0,
                 pin_memory: bool = False) -> DataLoader:
    """The collated micro-batches of optimizer steps ``steps`` (e.g. range(start, stop)), read by
    ``num_workers`` processes."""
    return DataLoader(dataset, batch_sampler=StepSampler(plan, steps), collate_fn=collate_fn,
                      num_workers=num_workers, pin_memory=pin_memory)
