"""Speculative decoding of the verifier with an EAGLE-3 drafter: the ladder prefill -> draft_k -> verify -> accept.

    plain = greedy_decode(verifier, prompt_ids, max_new_tokens=64, eos_ids={2})
    spec = speculative_decode(verifier, drafter, prompt_ids, layer_ids=(2, 15, 27), draft_tokens=7,
                              max_new_tokens=64, eos_ids={2})
    assert spec.tokens == plain          # greedy verification is lossless
    spec.accepted                        # drafts accepted per verifier forward; τ = accepted + 1

Why: the ``evaluate`` stage measures a drafter by really decoding with it, the way SGLang's EAGLE-3
worker does (batch 1, chain drafting, greedy verification, KV caches on both models), so a broken
export shows up as τ ≈ 1 instead of as a plausible training loss.

Bookkeeping for a prompt x_0..x_{n-1}; g_t = the verifier's tapped features at input x_t (the
residual streams entering the drafter's aux layers, HF ``hidden_states[k]``, concatenated):

- ``prefill``: verifier over x_0..x_{n-1}; its greedy token x_n is the first output token.
- ``draft_k``: drafter context step over rows t = 0..n-1, row t = (g_t, token x_{t+1}) at RoPE
  position t (the training alignment: (g_t, x_{t+1}) predicts x_{t+2}); the last row proposes
  d_1. Chain steps then feed d_i with the drafter's own pre-norm h2 of the previous step at
  positions n, n+1, ..., continuing context row n-1, and propose d_2..d_K.
- ``verify``: verifier over [x_n, d_1..d_K] at positions n..n+K: greedy y_0..y_K and features.
- ``accept``: j accepted drafts; output d_1..d_j, y_j. The verifier cache drops the K - j rejected
  positions; the drafter's next context step covers rows n..n+j, row n+i = (g of input i, next
  token), which also discards its chain keys (``KVCache.add_context`` clears the chain).

Worked example, n = 5, K = 3, drafts accepted j = 1: verify feeds positions 5..8 = [x_5, d_1, d_2,
d_3]; y_0 == d_1, y_1 != d_2, so the output grows by [d_1, y_1]; the verifier cache is cropped from
9 to 7 positions (x_0..x_5, d_1); the next draft_k is a context step over rows 5, 6 = (g(x_5), d_1),
(g(d_1), y_1) at positions 5, 6, and its chain steps run at positions 7, 8, ... continuing row 6.

The drafter interface is that of ``Eagle3Drafter``: ``fc`` (features [B, T, 3H] -> hidden),
``step(input_ids, hidden, position_ids, cache, rows) -> h2``, ``logits(h2) -> [..., Vd]`` and
``d2t``; ``ConstantDrafter`` (the baseline) implements the same. Logits are computed for the
rows that propose a token only (the context step's last row), never over a whole prompt.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from eagle3.model import KVCache


@dataclass
class Decoded:
    """The output of one speculative decode."""

    tokens: list[int]  # generated tokens after the prompt, up to and including EOS, at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # per verifier forward after prefill: drafts accepted 0..K


class ConstantDrafter(nn.Module):
    """A drafter that proposes one fixed target token at every step (the baseline of ``evaluate``).

    Draft vocabulary of size 1 whose only entry maps to ``token_id`` (target = 0 + d2t[0]).
    """

    def __init__(self, token_id: int):
        super().__init__()
        self.fc = nn.Identity()
        self.register_buffer("d2t", torch.tensor([token_id]))

    def step(self, input_ids: Tensor, hidden: Tensor, position_ids: Tensor, cache: KVCache,
             rows: Tensor | None = None) -> Tensor:
        return hidden  # h2: unused

    def logits(self, h2: Tensor) -> Tensor:
        return h2.new_zeros(*h2.shape[:-1], 1)  # [..., Vd=1]: always draft id 0


def tapped_features(hidden_states: Sequence[Tensor], layer_ids: Sequence[int]) -> Tensor:
    """concat of the residual streams entering layers ``layer_ids`` (HF hidden_states[k]): [B, T, 3H]."""
    return torch.cat([hidden_states[k] for k in layer_ids], -1)


def cache_kwargs(verifier, cache: DynamicCache) -> dict:
    """The KV-cache arguments of the verifier's forward: ``cache`` in recent transformers 5, else (older 5.x,
    remote code) ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def forward_verifier(verifier, cache: DynamicCache, input_ids: Tensor, layer_ids: Sequence[int],
                     logits_to_keep: int = 0) -> tuple[Tensor, Tensor]:
    """Verifier over input_ids [1, T] appended to ``cache``: (greedy next ids [T'], features [1, T, 3H]).

    T' = T, or the last ``logits_to_keep`` positions when it is > 0.
    """
    out = verifier(input_ids=input_ids, output_hidden_states=True, logits_to_keep=logits_to_keep,
                   **cache_kwargs(verifier, cache))
    return out.logits[0].argmax(-1), tapped_features(out.hidden_states, layer_ids)


def new_cache() -> DynamicCache:
    """A verifier KV cache whose every layer can be rolled back to any length.

    ``DynamicCache(config=...)`` gives sliding-window layers (Mistral, hybrid families) a cache that
    keeps only the last window - 1 keys, which transformers refuses to crop once the window is full
    ("crop was called, but the current layer does not track past states"). Without a config every
    layer keeps all its keys; a sliding layer still sees only its window, since the model builds its
    masks from positions (``create_sliding_window_causal_mask``), not from what the cache holds.
    """
    return DynamicCache()


def rollback(cache: DynamicCache, tokens: int) -> None:
    """Drop the last ``tokens`` positions of every layer.

    Nothing to drop (every draft accepted) skips the call: some transformers 5.x releases read a
    non-negative ``crop`` argument as the length to keep, so ``crop(0)`` would empty the cache.
    """
    if tokens > 0:
        cache.crop(-tokens)


@torch.no_grad()
def prefill(verifier, prompt_ids: Tensor, layer_ids: Sequence[int]) -> tuple[DynamicCache, Tensor, Tensor]:
    """Verifier over the prompt x_0..x_{n-1}: (cache, x_n [1], features g_0..g_{n-1} [1, n, 3H])."""
    cache = new_cache()
    next_id, features = forward_verifier(verifier, cache, prompt_ids, layer_ids, logits_to_keep=1)
    return cache, next_id, features


def draft_ids_to_target(drafter: nn.Module, draft_ids: Tensor) -> Tensor:
    """Target ids of draft-vocabulary ids: target = draft + d2t[draft]."""
    return draft_ids + drafter.d2t[draft_ids]


@torch.no_grad()
def draft_k(drafter: nn.Module, cache: KVCache, features: Tensor, next_ids: Tensor, start: int, k: int) -> Tensor:
    """K chain drafts [k] (target ids) after a context step over the newly accepted rows.

    features [1, m, 3H] are the verifier's at the inputs of rows start..start+m-1; next_ids [m]
    the token that followed each of those inputs. Example: after prefill of 5 tokens, start = 0,
    m = 5, next_ids = x_1..x_5; the chain then continues row 4 at positions 5, 6, ...
    """
    m = next_ids.shape[0]
    positions = torch.arange(start, start + m, device=next_ids.device)  # [m]
    h2 = drafter.step(next_ids[None], drafter.fc(features), positions, cache)  # [1, m, H]
    hidden = h2[:, -1:]  # [1, 1, H]: the last row continues into the chain
    row = positions[-1:]  # [1] context index the chain continues
    drafts = []
    for step in range(k):
        token = draft_ids_to_target(drafter, drafter.logits(hidden).argmax(-1))  # [1, 1]
        drafts.append(token)
        if step < k - 1:
            hidden = drafter.step(token, hidden, row + step + 1, cache, rows=row)  # own h2 as hidden input
    return torch.cat(drafts, 1)[0]


@torch.no_grad()
def verify(verifier, cache: DynamicCache, last_id: Tensor, drafts: Tensor, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """One verifier forward over [last accepted token, d_1..d_K]: (greedy y_0..y_K [K+1], features [1, K+1, 3H])."""
    return forward_verifier(verifier, cache, torch.cat([last_id, drafts])[None], layer_ids)


def accept(drafts: Tensor, greedy: Tensor) -> int:
    """Number j of accepted drafts, 0..K.

    Acceptance rule (greedy verification): draft d_i is accepted iff it and every earlier draft
    equal the verifier's argmax at the position before it (d_i == y_{i-1} for all i <= j). The
    first mismatch and everything after it are rejected; the verifier's own y_j is then emitted as
    the bonus token, so each verifier forward yields j + 1 tokens, all exactly greedy ones.
    """
    matches = (drafts == greedy[:-1]).long().cumprod(0)  # [K]: 1 up to the first mismatch
    return int(matches.sum())


def truncate(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Tokens up to and including the first EOS, at most ``max_new_tokens``: what greedy decoding emits."""
    tokens = tokens[:max_new_tokens]
    ends = [i for i, token in enumerate(tokens) if token in eos_ids]
    return tokens[: ends[0] + 1] if ends else tokens


@torch.no_grad()
def speculative_decode(verifier, drafter: nn.Module, prompt_ids: Tensor, layer_ids: Sequence[int], draft_tokens: int,
                       max_new_tokens: int, eos_ids: set[int]) -> Decoded:
    """Greedy decoding of ``verifier`` from prompt_ids [1, n], sped up by ``drafter``'s chain drafts."""
    vcache, next_id, features = prefill(verifier, prompt_ids, layer_ids)
    dcache = KVCache()
    tokens = next_id.tolist()
    next_ids = torch.cat([prompt_ids[0, 1:], next_id])  # x_1..x_n for drafter rows 0..n-1
    start, accepted = 0, []
    while len(tokens) < max_new_tokens and not eos_ids.intersection(tokens):
        drafts = draft_k(drafter, dcache, features, next_ids, start, draft_tokens)
        greedy, verified = verify(verifier, vcache, next_ids[-1:], drafts, layer_ids)
        j = accept(drafts, greedy)
        rollback(vcache, draft_tokens - j)  # keep [last, d_1..d_j]; the bonus y_j is next step's input
        start += len(next_ids)
        next_ids = torch.cat([drafts[:j], greedy[j : j + 1]])  # [j + 1] new tokens
        features = verified[:, : j + 1]  # features at the inputs [last, d_1..d_j]
        tokens += next_ids.tolist()
        accepted.append(j)
    return Decoded(truncate(tokens, max_new_tokens, eos_ids), accepted)


@torch.no_grad()
def greedy_decode(verifier, prompt_ids: Tensor, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Plain greedy decoding with a KV cache, one verifier forward per token (the reference and the speed baseline)."""
    cache = new_cache()
    input_ids, tokens = prompt_ids, []
    while len(tokens) < max_new_tokens and not (tokens and tokens[-1] in eos_ids):
        logits = verifier(input_ids=input_ids, logits_to_keep=1, **cache_kwargs(verifier, cache)).logits
        input_ids = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        tokens.append(int(input_ids))
    return tokens
