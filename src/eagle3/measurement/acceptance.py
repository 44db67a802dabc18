"""τ and its breakdown from the drafts accepted per verifier forward: what ``evaluate`` reports per method.

    acceptance_stats([0, 2, 1, 2], k=2)["tau"]   # 2.25

Why: every method (chain, tree, the baselines, the chain K sweep) is compared by the same numbers,
computed one way from what decoding returns (``Decoded.accepted``).
"""

from __future__ import annotations

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
