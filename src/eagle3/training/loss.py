"""The EAGLE-3 objective: training-time test (TTT) over K draft steps, and its metrics (docs/design.md §1).

    selection = select_rows(loss_mask, position_ids, steps=7)      # on the host, from the batch
    targets = VerifierHead(lm_head_weight, d2t)(final, selection.positions)   # frozen, no grad
    ce, sums = TrainingTimeTest(drafter, steps=7, normalisation="token")(input_ids, aux, position_ids, targets, selection)
    loss = ttt_loss(ce, step_counts(targets, selection, "token"), decay=0.8)
    StepMetrics(sums).summary(0.8)  # loss, loss_k, acc_k, cond_acc_k, sim_accept_len

Alignment (T = row length; rows t = 0..T-1 go through the layer in every step). A row packs
several documents (samples); ``position_ids`` [B, T] restart at 0 in each, and the padding tail
of a row counts as one more document without targets:

- Targets sit at the positions s where x_{s+1} is under the loss mask and in s's document: the
  verifier's distribution of x_{s+1} restricted to the draft vocabulary; valid where its argmax is
  a draft token.
- Step k, row t: token input x_{t+k+1}; hidden input fc(g_t) at k=0, else row t's h2 of step k-1;
  RoPE position p_t+k; target at s = t+k+1 (the distribution of x_{t+k+2}), scored only when
  s is in t's document. Attention: step-0 keys of the rows of t's document up to t, plus row t's
  keys of steps 1..k (model.py). Rows near a document's end read tokens of the next document at
  steps > 0, but they have no target then, and no other row sees their keys of those steps.
  Only rows with a target get logits: the lm_head over Vd is most of the cost, and prompts are
  most of the rows.

Normalisation (``train.loss_normalisation``): step k's loss is a mean over the global batch, either
over its valid targets (``token``: a 2,000-token answer weighs 15 times a 130-token one) or over its
documents with a valid target, each the mean over its own valid targets (``sequence``: every
document weighs the same). Either way ``ttt_loss`` divides global sums by global counts, so the
cut of the batch into micro-batches and processes changes nothing (a document lies in one row).

Why a separate module: the model is one step; the unroll, the shifts and the metrics are the
objective, and DDP/FSDP wrap ``TrainingTimeTest`` so one forward is one whole unroll.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from eagle3.drafter.attention import KVCache
from eagle3.drafter.fused import fused_when_training_on_gpu
from eagle3.drafter.model import Eagle3Drafter


def shift_left(x: Tensor, n: int, fill=0) -> Tensor:
    """Shift x [B, T, ...] left by n along T, padding the right end with ``fill``; same shape.

    Worked example (T=5): shift_left([[a, b, c, d, e]], 2) == [[c, d, e, 0, 0]]: row t now holds
    x[t+2], and the last 2 rows, which have no such entry, hold ``fill``.
    """
    n = min(n, x.shape[1])
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], 1)


@dataclass
class Selection:
    """Which flat rows (b*T + t) each TTT step scores, and against which target (host-computed)."""

    positions: Tensor  # [N] flat b*T + s of every target position (x_{s+1} under the loss mask)
    rows: list[Tensor]  # step k: [N_k] flat rows b*T + t with t = s-k-1 >= 0
    picks: list[Tensor]  # step k: [N_k] index into the N targets of each of those rows
    documents: Tensor  # [N] the document of each target: 0, 1, ... over the micro-batch's documents with targets
    padded: Tensor | None = None  # [N] True on the targets ``pad`` appended (never valid); None: nothing appended

    def to(self, device, non_blocking: bool = False) -> Selection:
        return self.map(lambda x: x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Selection:
        """Page-locked copies (a DataLoader with ``pin_memory`` calls this), so the copy to the GPU does not block."""
        return self.map(Tensor.pin_memory)

    def map(self, fn) -> Selection:
        return Selection(fn(self.positions), [fn(r) for r in self.rows], [fn(p) for p in self.picks], fn(self.documents),
                         None if self.padded is None else fn(self.padded))

    def tensors(self) -> list[Tensor]:
        return [self.positions, *self.rows, *self.picks, self.documents, *([] if self.padded is None else [self.padded])]

    def pad(self, flat_rows: int) -> Selection:
        """This selection with every tensor of one size, ``static_size`` of the target count: what a CUDA graph
        replays (``train.cuda_graphs``), one graph per size instead of one per batch. Appended targets sit at flat
        position 0 and are marked ``padded`` (the verifier head makes them invalid); each step's appended rows pick
        the first appended target and point at ``flat_rows`` (= B*T, one past the last row: gathered clamped, their
        flags scattered into a slot that is dropped), so they add nothing to a loss, count or metric.

        Worked example (3 targets, 2 scored at step 0, flat_rows 12): static_size(3) = 4; positions [p0, p1, p2, 0],
        step 0's rows [r0, r1, 12, 12] and picks [i0, i1, 3, 3], padded [F, F, F, T].
        """
        n = len(self.positions)
        size = static_size(n)

        def extend(x: Tensor, fill: int) -> Tensor:
            return torch.cat([x, x.new_full((size - len(x),), fill)])

        return Selection(extend(self.positions, 0), [extend(r, flat_rows) for r in self.rows],
                         [extend(p, n) for p in self.picks], extend(self.documents, 0), torch.arange(size) >= n)


def static_size(n: int) -> int:
    """The size ``Selection.pad`` gives n targets: the next multiple of 2^(bits(n) - 4) above n, so at most 8
    sizes an octave (8 CUDA graphs for every count from 2,048 to 4,095 targets), at most n/8 appended, and at
    least one appended target for the padded rows to pick: 3 -> 4, 3,198 -> 3,328, 4,096 -> 4,608."""
    quantum = 2 ** max(0, n.bit_length() - 4)
    return (n // quantum + 1) * quantum


def select_rows(loss_mask: Tensor, position_ids: Tensor, steps: int) -> Selection:
    """The rows each step trains, from loss_mask [B, T] (1 on tokens to predict) and the
    per-document position_ids [B, T].

    Worked example (B=1, T=6, loss_mask [0, 0, 0, 1, 1, 0], one document: positions 0..5): x_3 and
    x_4 are to be predicted, so targets sit at s = 2, 3 (positions [2, 3]). Step 0 scores rows
    t = s-1 = [1, 2] (picks [0, 1]); step 1 rows [0, 1] (picks [0, 1]); step 2 row [0] (pick [1]:
    target 0 would need row -1); step 3 nothing. Packed as documents of 3 + 3 tokens (positions
    [0, 1, 2, 0, 1, 2]), x_3 opens the second document: no target predicts it, and target s = 3
    (predicting x_4) needs row t = 2 at step 0, which is in the other document: nothing is scored.
    With B > 1, row b's flat indices are offset by b*T. Targets no step scores (a target at a
    document's first token) are left out, so the verifier head never computes them. ``documents``
    numbers the documents that hold targets in flat order: targets at s = [2, 3] of row 0 and [1]
    of row 1, each row one document, give [0, 0, 1].
    """
    next_continues = shift_left(position_ids, 1, -1) == position_ids + 1  # [B, T]: x_{s+1} is in s's document
    scored = shift_left(loss_mask.bool(), 1, False) & next_continues & (position_ids >= 1)  # step 0 has row s-1
    positions = scored.flatten().nonzero().squeeze(1)  # [N]
    offset = position_ids.flatten()[positions]  # [N] index of s in its document
    picks = [(offset >= k + 1).nonzero().squeeze(1) for k in range(steps)]  # t = s-k-1 must be in the document
    document = (position_ids.flatten() == 0).cumsum(0)  # [B*T] flat document index: each row and document starts at 0
    documents = document[positions].unique_consecutive(return_inverse=True)[1]  # [N] (positions ascend)
    return Selection(positions, [positions[p] - (k + 1) for k, p in enumerate(picks)], picks, documents)


@dataclass
class Targets:
    """The verifier's targets at the N target positions of a ``Selection``."""

    probs: Tensor  # [N, Vd] softmax of the verifier logits restricted to the draft vocab
    index: Tensor  # [N] draft index of the verifier's argmax (meaningful where valid)
    valid: Tensor  # [N] bool: the argmax is a draft token (else the position is masked)


def step_weights(targets: Targets, selection: Selection, normalisation: str) -> tuple[Tensor, list[Tensor | None]]:
    """By ``train.loss_normalisation``: the denominators of the per-step means [K] (float) and, step k,
    each scored row's CE weight [N_k] (None: every row weighs 1). ``token``: each step's valid targets,
    weights 1. ``sequence``: its documents with at least one valid target, and weights 1 / the valid
    targets of the row's document at that step, so a step's CE sum is the sum over documents of their
    mean CE. On the device, without a host sync."""
    if normalisation == "token":
        return torch.stack([targets.valid[pick].sum() for pick in selection.picks]).float(), [None] * len(selection.picks)
    zeros = torch.zeros(len(selection.positions), device=targets.valid.device)  # documents are numbered below N
    sizes = [zeros.index_add(0, selection.documents[pick], targets.valid[pick].float()) for pick in selection.picks]
    counts = torch.stack([(size > 0).sum() for size in sizes]).float()
    return counts, [1 / size[selection.documents[pick]].clamp(min=1) for size, pick in zip(sizes, selection.picks)]


def step_counts(targets: Targets, selection: Selection, normalisation: str) -> Tensor:
    """``step_weights``' denominators [K]: what the train loop all-reduces before any backward."""
    return step_weights(targets, selection, normalisation)[0]


class VerifierHead(nn.Module):
    """The verifier's frozen lm_head over its stored post-norm final states -> ``Targets``.

    ``lm_head_weight`` [V, H] is used in its own dtype (give it in the compute dtype). Its rows are
    split once into the draft vocabulary [Vd, H] and the rest [V - Vd, H]: the targets need the
    draft logits, and of the rest only their maximum (is the verifier's argmax a draft token?),
    so the [N, V] logits are never materialised or gathered. The argmax over the full vocabulary
    is kept exactly, ties included (the lowest token id wins, as ``argmax`` does).
    """

    def __init__(self, lm_head_weight: Tensor, d2t: Tensor):
        super().__init__()
        draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # [Vd] target id of each draft token (ascending)
        in_draft = torch.zeros(lm_head_weight.shape[0], dtype=torch.bool, device=d2t.device)
        in_draft[draft_ids] = True
        rest_ids = (~in_draft).nonzero().squeeze(1)  # [V - Vd]
        weight = lm_head_weight.detach()
        self.register_buffer("draft_weight", weight[draft_ids], persistent=False)  # [Vd, H]
        self.register_buffer("rest_weight", weight[rest_ids], persistent=False)  # [V - Vd, H]
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        self.register_buffer("rest_ids", rest_ids, persistent=False)

    @torch.no_grad()
    def forward(self, final: Tensor, positions: Tensor, padded: Tensor | None = None) -> Targets:
        """final [B, T, H] at flat positions [N] -> Targets [N]; ``padded`` [N] (``Selection.pad``): never valid."""
        hidden = final.flatten(0, 1)[positions].to(self.draft_weight.dtype)  # [N, H]
        draft = hidden @ self.draft_weight.T  # [N, Vd]
        best, index = draft.max(-1)  # [N]: first maximum = lowest token id (draft ids ascend)
        valid = torch.ones_like(best, dtype=torch.bool)
        if len(self.rest_ids):
            other, at = (hidden @ self.rest_weight.T).max(-1)  # [N] best non-draft logit
            valid = (best > other) | ((best == other) & (self.draft_ids[index] < self.rest_ids[at]))
        if padded is not None:
            valid = valid & ~padded
        return Targets(draft.float().softmax(-1), index, valid)


class TrainingTimeTest(nn.Module):
    """The drafter unrolled over K steps; forward returns (soft CE sums [K], metric sums [6, K]).

    ``normalisation`` (``train.loss_normalisation``): ``token`` sums each step's CE over its valid targets;
    ``sequence`` weighs each by 1 / its document's valid targets at that step, so the sum is over
    documents of their mean CE. ``step_counts`` with the same value gives the matching denominators (``step_weights``).
    """

    def __init__(self, drafter: Eagle3Drafter, steps: int, normalisation: str):
        super().__init__()
        self.drafter = drafter
        self.steps = steps
        self.normalisation = normalisation

    def forward(self, input_ids: Tensor, aux: Tensor, position_ids: Tensor, targets: Targets,
                selection: Selection) -> tuple[Tensor, Tensor]:
        """input_ids [B, T], aux [B, T, 3H], position_ids [B, T] (per document) -> per-step summed
        soft CE [K] and ``StepMetrics`` sums."""
        B, T = input_ids.shape
        every_row = torch.arange(T, device=input_ids.device)
        cache = KVCache(starts=every_row - position_ids)  # [B, T]: row t's document begins at t - p_t
        hidden = self.drafter.fc(aux)  # [B, T, H]
        counts, scales = step_weights(targets, selection, self.normalisation)
        ce, right, valid, scored = [], [], [], []
        for k in range(self.steps):
            tokens = shift_left(input_ids, k + 1)  # row t: x_{t+k+1}
            hidden = self.drafter.step(tokens, hidden, position_ids + k, cache, None if k == 0 else every_row)
            rows, pick = selection.rows[k], selection.picks[k]
            taken = rows if selection.padded is None else rows.clamp(max=B * T - 1)  # appended rows point past the end
            logits = self.drafter.logits(hidden.flatten(0, 1)[taken])  # [N_k, Vd]
            ok = targets.valid[pick]  # [N_k]
            ce.append(soft_cross_entropy_sum(logits, targets.probs, pick, ok, scales[k]))
            right.append(on_rows(logits.detach().argmax(-1) == targets.index[pick], rows, B * T))
            valid.append(on_rows(ok, rows, B * T))
            scored.append(on_rows(torch.ones_like(ok), rows, B * T))
        ce = torch.stack(ce)  # [K]
        return ce, metric_sums(ce.detach(), counts, torch.stack(right), torch.stack(valid), torch.stack(scored))


def on_rows(values: Tensor, rows: Tensor, size: int) -> Tensor:
    """Scatter per-row flags [N_k] onto all ``size`` flat rows (False elsewhere): [size]. Rows at ``size`` (those
    ``Selection.pad`` appended) land in one more slot, which is dropped."""
    return torch.zeros(size + 1, dtype=torch.bool, device=values.device).index_put_((rows,), values)[:size]


@fused_when_training_on_gpu
def soft_cross_entropy_sum(logits: Tensor, probs: Tensor, pick: Tensor, ok: Tensor, scale: Tensor | None = None) -> Tensor:
    """Σ_i scale_i · -Σ_v probs[pick_i, v] log softmax(logits_i)_v over the rows i whose target is valid:
    logits [N_k, Vd], probs [N, Vd], pick [N_k] (row i's target), ok [N_k], scale [N_k] or None
    (every row weighs 1) -> a scalar.

    The targets are picked inside (fused, no [N_k, Vd] copy of the probabilities per step).
    """
    ce = -(probs[pick] * logits.float().log_softmax(-1)).sum(-1)  # [N_k]
    ce = torch.where(ok, ce, 0.0)
    return (ce if scale is None else ce * scale).sum()


def ttt_loss(ce: Tensor, counts: Tensor, decay: float) -> Tensor:
    """Σ_k decay^k · ce[k] / counts[k]: step k's soft CE averaged over its valid positions.

    ``counts`` are those of the whole global batch (all micro-batches and ranks), so that gradient
    accumulation and data parallelism give the gradient of one big batch.
    """
    weights = decay ** torch.arange(len(ce), device=ce.device, dtype=torch.float32)
    return (weights * ce / counts.clamp(min=1)).sum()


def metric_sums(ce: Tensor, counts: Tensor, right: Tensor, valid: Tensor, scored: Tensor) -> Tensor:
    """Rows of ``StepMetrics`` [6, K] from the loss's sums ce [K] and denominators counts [K]
    (``step_counts``) and right/valid/scored [K, R] (flat row r of step k; scored: the row has a
    target at step k, valid: that target's argmax is a draft token)."""
    hit = right & valid
    chain = torch.cumprod(hit.int(), 0).bool()  # [K, R]: right and valid at every step <= k
    before = torch.cat([torch.ones_like(chain[:1]), chain[:-1]])  # right and valid at every step < k
    return torch.stack([ce, counts, scored.sum(1).float(), hit.sum(1).float(), chain.sum(1).float(),
                        (before & scored).sum(1).float()])


@dataclass
class StepMetrics:
    """Per-step sums [6, K]: the loss's soft CE and denominator (``step_counts``), all targets, hits,
    chain hits, chain candidates.

    Sums add across micro-batches and ranks (all-reduce ``sums``); ratios are taken only here.
    """

    sums: Tensor

    def summary(self, decay: float) -> dict[str, float]:
        """loss, loss_k (the objective: over valid targets, which alone have a draft-vocabulary
        distribution, per token or per document as the run's normalisation says), acc_k
        (draft argmax == verifier argmax), cond_acc_k (given steps < k right), sim_accept_len =
        Σ_k Π_{j<=k} cond_acc_j: the draft tokens a greedy chain gets accepted per verify step (bonus
        token excluded), as decoding accepts them — draft k counts only where drafts 0..k-1 were
        right. The product of unconditional accuracies instead treats the steps' hits as independent
        and undercounts chains (their hits are correlated); the export is picked by this number.

        Accuracies are over *all* targets of a step: one whose verifier argmax lies outside the
        draft vocabulary is a miss, as it is when decoding (the drafter cannot propose it). Over
        the valid ones only, a small vocabulary inflates them by 1 / its coverage (the demo's 256
        tokens cover about half of its validation targets: acc_0 read twice what decoding accepts).
        The accuracies and sim_accept_len are per token whatever the loss's normalisation: they
        measure what decoding accepts, not the objective.
        """
        ce, count, targets, hit, chain, candidates = self.sums.double().cpu()  # host sync: log time only
        acc = hit / targets.clamp(min=1)
        cond = chain / candidates.clamp(min=1)
        out = {"loss": float(ttt_loss(ce.float(), count.float(), decay)), "sim_accept_len": float(torch.cumprod(cond, 0).sum())}
        for k in range(len(ce)):
            out[f"loss_{k}"] = float(ce[k] / count[k].clamp(min=1))
            out[f"acc_{k}"] = float(acc[k])
            out[f"cond_acc_{k}"] = float(cond[k])
        return out
