"""How the ``local`` backend draws a sampled answer's tokens: every path (transformers ``generate``, slot decoding,
its CUDA graphs) draws by this one rule.

    draw = Sampling(temperature=0.7, top_p=1.0)
    tokens = draw(logits, seeds, index)   # logits [n, V], seeds [n] (the records'), index [n] (tokens drawn so far)

Row i's token comes from softmax(logits[i] / temperature) (top_p: its nucleus) by inverse CDF at one uniform number,
a hash of (seeds[i], index[i]). Why a hash and not a ``torch.Generator`` per row: the draw depends on the row alone,
never on the rows beside it or on how many draws came before in its batch, and it is a few tensor operations: no
host loop over rows, no generator state, so a CUDA graph captures it with the decode step. Temperature 0 is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOW32 = 0xFFFFFFFF


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Zero the tail of each row of ``probs`` [B, V] beyond the smallest set holding ``top_p`` mass."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # mass before a token already >= top_p
    # masked_fill, not boolean indexing: no data-dependent shapes, so a CUDA graph can capture it
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))


def times32(x: Tensor, constant: int) -> Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32) held in int64, in two 16-bit halves of the constant so that no
    product leaves int64's range (its overflow is undefined)."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & LOW32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply, the "lowbias32" constants) of x in [0, 2^32): every bit of the
    input moves about half the output's."""
    x = x ^ (x >> 16)
    x = times32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: Tensor, index: Tensor) -> Tensor:
    """[n] numbers in [0, 1) on a grid of 2^-24 (exact in float32), each a function of (seeds[i], index[i]) alone
    (seeds up to 64 bits)."""
    seeds = seeds.long()
    x = mix32(mix32(mix32(seeds & LOW32) ^ ((seeds >> 32) & LOW32)) ^ (index.long() & LOW32))
    return (x >> 8).float() / (1 << 24)


@dataclass(frozen=True)
class Sampling:
    """``generate.temperature`` (0: greedy) and ``generate.top_p`` of the answers being decoded."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __call__(self, logits: Tensor, seeds: Tensor, index: Tensor) -> Tensor:
        """logits [n, V], seeds [n], index [n] -> the tokens drawn [n]."""
        if self.temperature == 0:
            return logits.argmax(-1)
        probs = top_p_filter(torch.softmax(logits.float() / self.temperature, dim=-1), self.top_p)
        cdf = probs.cumsum(-1)  # [n, V]
        total = cdf[:, -1:]
        # the first token whose cumulative mass passes u * total: never one of mass 0; kept below total, which a
        # rounding of u * total could reach (no token's cumulative mass passes it)
        point = torch.minimum(uniforms(seeds, index)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, point, right=True).squeeze(1)


GREEDY = Sampling()
