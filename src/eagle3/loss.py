"""The EAGLE-3 objective: training-time test (TTT) over K draft steps, and its metrics (DESIGN.md §5).

    head = VerifierHead(lm_head_weight, d2t, norm_weight=None)     # frozen; None: `final` is post-norm
    targets = head(final, loss_mask)                                # once per batch, no grad
    ce, sums = TrainingTimeTest(drafter, steps=7)(input_ids, aux, targets)
    loss = ttt_loss(ce, step_counts(targets, 7), decay=0.8)
    StepMetrics(sums).summary(0.8)  # loss, loss_k, acc_k, cond_acc_k, sim_accept_len

Alignment (T = sequence length, rows t = 0..T-1 in every step):

- ``Targets`` are per position s: the verifier's distribution of x_{s+1} (restricted to the draft
  vocabulary), valid where x_{s+1} is under the loss mask and the verifier's argmax is a draft token.
- Step k, row t: token input x_{t+k+1}; hidden input fc(g_t) at k=0, else row t's h2 of step k-1;
  RoPE position t+k; target = ``Targets`` at s = t+k+1 (the distribution of x_{t+k+2}).
  Attention: context keys of step 0 at rows <= t, plus row t's keys of steps 1..k (model.py).

Why a separate module: the model is one step; the unroll, the shifts and the metrics are the
objective, and DDP/FSDP wrap ``TrainingTimeTest`` so one forward is one whole unroll.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from eagle3.model import Eagle3Drafter, KVCache, RMSNorm


def shift_left(x: Tensor, n: int, fill=0) -> Tensor:
    """Shift x [B, T, ...] left by n along T, padding the right end with ``fill``; same shape.

    Worked example (T=5): shift_left([[a, b, c, d, e]], 2) == [[c, d, e, 0, 0]]: row t now holds
    x[t+2], and the last 2 rows, which have no such entry, hold ``fill``.
    """
    T = x.shape[1]
    n = min(n, T)
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


@dataclass
class Targets:
    """The verifier's next-token targets at every position s (they describe x_{s+1})."""

    probs: Tensor  # [B, T, Vd] softmax of the verifier logits restricted to the draft vocab
    index: Tensor  # [B, T] draft index of the verifier's argmax (meaningful where valid)
    valid: Tensor  # [B, T] bool: loss_mask[s+1] and the argmax is in the draft vocab

    def at_step(self, k: int) -> Targets:
        """What row t of TTT step k is trained on: the targets at s = t+k+1.

        Worked example (T=5, k=1): row 0 gets position 2 (the distribution of x_3), row 2 gets
        position 4, rows 3 and 4 get nothing (probs 0, valid False).
        """
        return Targets(shift_left(self.probs, k + 1), shift_left(self.index, k + 1), shift_left(self.valid, k + 1, False))


def step_counts(targets: Targets, steps: int) -> Tensor:
    """Valid positions of each TTT step [K] (float): the denominators of the per-step means."""
    return torch.stack([targets.at_step(k).valid.sum() for k in range(steps)]).float()


class VerifierHead(nn.Module):
    """The verifier's frozen lm_head (and final norm if the stored state is pre-norm) -> ``Targets``.

    ``lm_head_weight`` [V, H] is used in its own dtype (give it in the compute dtype).
    """

    def __init__(self, lm_head_weight: Tensor, d2t: Tensor, norm_weight: Tensor | None = None, eps: float = 1e-5):
        super().__init__()
        vocab = lm_head_weight.shape[0]
        draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # [Vd] target id of each draft token
        draft_index = torch.full((vocab,), -1, dtype=torch.long, device=d2t.device)
        draft_index[draft_ids] = torch.arange(len(d2t), device=d2t.device)  # [V] draft index or -1
        self.register_buffer("weight", lm_head_weight.detach(), persistent=False)
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.register_buffer("draft_index", draft_index, persistent=False)
        self.norm = None
        if norm_weight is not None:
            self.norm = RMSNorm(len(norm_weight), eps).requires_grad_(False)
            self.norm.weight.data.copy_(norm_weight)

    @torch.no_grad()
    def forward(self, final: Tensor, loss_mask: Tensor) -> Targets:
        """final [B, T, H], loss_mask [B, T] -> Targets at every position."""
        hidden = final if self.norm is None else self.norm(final)
        logits = hidden.to(self.weight.dtype) @ self.weight.T  # [B, T, V]
        index = self.draft_index[logits.argmax(-1)]  # [B, T]; -1 where the argmax is not a draft token
        probs = logits[..., self.draft_ids].float().softmax(-1)  # [B, T, Vd]
        valid = shift_left(loss_mask.bool(), 1, False) & (index >= 0)  # position s predicts x_{s+1}
        return Targets(probs, index.clamp(min=0), valid)


class TrainingTimeTest(nn.Module):
    """The drafter unrolled over K steps; forward returns (soft CE sums [K], metric sums [5, K])."""

    def __init__(self, drafter: Eagle3Drafter, steps: int):
        super().__init__()
        self.drafter = drafter
        self.steps = steps

    def forward(self, input_ids: Tensor, aux: Tensor, targets: Targets) -> tuple[Tensor, Tensor]:
        """input_ids [B, T], aux [B, T, 3H] -> per-step summed soft CE [K] and ``StepMetrics`` sums."""
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device)  # row t of step k sits at position t+k
        cache, hidden = KVCache(), self.drafter.fc(aux)  # [B, T, H]
        ce, right, valid = [], [], []
        for k in range(self.steps):
            tokens = shift_left(input_ids, k + 1)  # row t: x_{t+k+1}
            logits, hidden = self.drafter(tokens, hidden, positions + k, cache, None if k == 0 else positions)
            step = targets.at_step(k)
            ce.append(torch.where(step.valid, soft_cross_entropy(logits, step.probs), 0.0).sum())
            right.append(logits.detach().argmax(-1) == step.index)  # [B, T]
            valid.append(step.valid)
        ce = torch.stack(ce)  # [K]
        return ce, metric_sums(ce.detach(), torch.stack(right), torch.stack(valid))


def soft_cross_entropy(logits: Tensor, probs: Tensor) -> Tensor:
    """-Σ_v p_v log softmax(logits)_v per position: [B, T, Vd] x [B, T, Vd] -> [B, T]."""
    return -(probs * logits.float().log_softmax(-1)).sum(-1)


def ttt_loss(ce: Tensor, counts: Tensor, decay: float) -> Tensor:
    """Σ_k decay^k · ce[k] / counts[k]: step k's soft CE averaged over its valid positions.

    ``counts`` are those of the whole global batch (all micro-batches and ranks), so that gradient
    accumulation and data parallelism give the gradient of one big batch.
    """
    weights = decay ** torch.arange(len(ce), device=ce.device, dtype=torch.float32)
    return (weights * ce / counts.clamp(min=1)).sum()


def metric_sums(ce: Tensor, right: Tensor, valid: Tensor) -> Tensor:
    """Rows of ``StepMetrics`` [5, K] from ce [K], right/valid [K, B, T] (row t of step k)."""
    hit = right & valid
    chain = torch.cumprod(hit.int(), 0).bool()  # [K, B, T]: right and valid at every step <= k
    before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]])  # right and valid at every step < k
    return torch.stack([
        ce,
        valid.sum((1, 2)).float(),
        hit.sum((1, 2)).float(),
        chain.sum((1, 2)).float(),
        (before & valid).sum((1, 2)).float(),
    ])


@dataclass
class StepMetrics:
    """Per-step sums [5, K]: soft CE, valid positions, hits, chain hits, chain candidates.

    Sums add across micro-batches and ranks (all-reduce ``sums``); ratios are taken only here.
    """

    sums: Tensor

    def __add__(self, other: StepMetrics) -> StepMetrics:
        return StepMetrics(self.sums + other.sums)

    def summary(self, decay: float) -> dict[str, float]:
        """loss, loss_k, acc_k (draft argmax == verifier argmax), cond_acc_k (given steps < k right),
        sim_accept_len = Σ_k Π_{j<=k} acc_j (draft tokens accepted per verify step, bonus token excluded)."""
        ce, count, hit, chain, candidates = self.sums.double().cpu()  # host sync: log time only
        acc = hit / count.clamp(min=1)
        out = {"loss": float(ttt_loss(ce.float(), count.float(), decay)),
               "sim_accept_len": float(torch.cumprod(acc, 0).sum())}
        for k in range(len(ce)):
            out[f"loss_{k}"] = float(ce[k] / count[k].clamp(min=1))
            out[f"acc_{k}"] = float(acc[k])
            out[f"cond_acc_{k}"] = float(chain[k] / candidates[k].clamp(min=1))
        return out
