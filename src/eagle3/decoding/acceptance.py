"""τ and its breakdown from the drafts accepted per verifier forward: what ``evaluate`` reports per method.

    acceptance_stats([0, 2, 1, 2], k=2)["tau"]   # 2.25

    tau_by_position([[2, 0, 1]], edges=(4,))   # {"0-4": 3.0, "4+": 1.5}

Why: every method (chain, tree, the baselines, the chain K sweep) is compared by the same numbers,
computed one way from what decoding returns (``Decoded.accepted``); over long answers, also by
where in the answer the forwards were (acceptance drifts as an answer goes on).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


def acceptance_stats(accepted: Sequence[int], k: int) -> dict:
    """τ and its breakdown from the drafts accepted per verifier forward (j in 0..K; τ = j + 1).

    acceptance[i] = fraction of forwards that accepted draft i+1 (and so all before it), so
    tau = 1 + sum(acceptance); conditional[i] = that fraction among forwards that reached draft i+1;
    tau_distribution[i] = fraction of forwards with τ = i + 1. Example, K=2, accepted [0, 2, 1, 2]:
    tau 2.25, acceptance [0.75, 0.5], conditional [0.75, 0.667], tau_distribution [0.25, 0.25, 0.5].
    """
    counts = torch.bincount(torch.tensor(list(accepted), dtype=torch.long), minlength=k + 1).double()  # [K+1]
    forwards = counts.sum().clamp(min=1)  # no forwards (every prompt ended at prefill): τ reads 1
    reached = counts.flip(0).cumsum(0).flip(0)  # [K+1]: forwards with j >= i
    return {
        "forwards": len(accepted),
        "tau": float(1 + (reached[1:].sum() / forwards)),
        "acceptance": (reached[1:] / forwards).tolist(),
        "conditional": (reached[1:] / reached[:-1].clamp(min=1)).tolist(),
        "tau_distribution": (counts / forwards).tolist(),
    }


def bucket_names(edges: Sequence[int]) -> list[str]:
    """Names of the answer-position buckets cut at ``edges``: (64, 256) -> ["0-64", "64-256", "256+"]."""
    bounds = [0, *edges]
    return [f"{lo}-{hi}" for lo, hi in zip(bounds, bounds[1:])] + [f"{bounds[-1]}+"]


def tau_by_position(accepted: Sequence[Sequence[int]], edges: Sequence[int]) -> dict[str, float]:
    """τ per answer-position bucket: the mean of 1 + drafts accepted over the verifier forwards whose
    first new token falls in the bucket, from each answer's accepted drafts per forward (in order).

    A forward's first new token is the answer's token index it emits first (0-based): the prefill
    emits token 0, so an answer's first forward starts at 1, the next at 1 + its accepted + 1, and
    so on. Buckets without forwards are left out. Example, edges (4,), one answer accepted [2, 0, 1]:
    forwards start at 1, 4, 5 -> {"0-4": 3.0, "4+": 1.5}.
    """
    names, sums, counts = bucket_names(edges), {}, {}
    for answer in accepted:
        start = 1
        for j in answer:
            name = names[bisect.bisect_right(edges, start)]
            sums[name], counts[name] = sums.get(name, 0) + j + 1, counts.get(name, 0) + 1
            start += j + 1
    return {name: sums[name] / counts[name] for name in names if name in counts}
