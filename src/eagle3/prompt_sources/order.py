"""The deterministic orders of the prompt walk: a keyed hash per record, and a weighted interleave.

The seeded order of a pool sorts its records by ``order_key`` of their own bytes, so the order of
two records never depends on what else is in the pool; ``interleave`` merges streams so that every
prefix holds each stream's share, so a longer mixture extends a shorter one.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator, Sequence
from typing import Any


def order_key(seed: int, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8, key=str(seed).encode()).digest()


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
