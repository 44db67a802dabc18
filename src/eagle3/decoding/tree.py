"""Draft trees: their shape, a drafted tree, and how an EAGLE-3 drafter grows one (a chain is the tree of top-1).

    chain = EagleProposer(drafter, TreeShape.chain(7))                            # K = 7 chain drafts
    tree = EagleProposer(drafter, TreeShape(num_steps=5, topk=4, num_draft_tokens=16))   # SGLang's tree
    proposer.start(prompts, batch, features); draft = proposer.propose(); proposer.advance(round_)

Why: ``eagle3.decoding.speculative`` verifies whatever a proposer drafts; this is the proposer SGLang's
EAGLE-3 worker runs (``--speculative-num-steps``, ``-eagle-topk``, ``-num-draft-tokens``), so τ
is measured with the drafting an engine serves. A proposer is told what each verifier forward
accepted (``Round``) and answers with the next ``Draft``: nodes per row, each with its parent, the
root being the last verified token. History-only proposers (``eagle3.decoding.baselines``)
answer from the tokens alone.

The drafter interface is that of ``Eagle3Drafter``: ``fc`` (features [B, T, 3H] -> hidden),
``step(input_ids, hidden, position_ids, cache, rows) -> h2``, ``logits(h2) -> [..., Vd]`` and ``d2t``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3.decoding.batch import Batch
from eagle3.decoding.config import TreeShape
from eagle3.drafter.attention import KVCache


@dataclass
class Draft:
    """Draft nodes per row; block index 0 is the root (last verified token), node i is block index i + 1.

    Siblings carry distinct tokens (a node's children are its top-k), so at most one path matches.
    """

    tokens: Tensor  # [B, N] target ids
    parents: Tensor  # [B, N] block index of each node's parent, < its own (0: the root)
    valid: Tensor  # [B, N] bool: a node that may be accepted (history proposers propose fewer than N)

    @functools.cached_property
    def structure(self) -> tuple[Tensor, Tensor]:
        """(depth [B, 1 + N], ancestor-or-self [B, 1 + N, 1 + N] bool) of the block, for verify and accept."""
        return tree_structure(self.parents)


@dataclass
class Round:
    """What one verifier forward decided, for the proposers."""

    paths: list[list[int]]  # per row: accepted block indices, the root (0) first
    emitted: list[list[int]]  # per row: tokens this round adds (accepted drafts, then the bonus)
    features: Tensor  # [B, 1 + N, 3H] verifier features at the block's inputs
    root_positions: Tensor  # [B] position of block index 0


def tree_structure(parents: Tensor) -> tuple[Tensor, Tensor]:
    """(depth [B, 1 + N], ancestor-or-self [B, 1 + N, 1 + N] bool) of a draft's parents [B, N] (block indices)."""
    B, N = parents.shape
    depth = parents.new_zeros(B, N + 1)
    ancestors = torch.eye(N + 1, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    rows = torch.arange(B, device=parents.device)
    for i in range(1, N + 1):  # parents come first, so theirs are complete
        parent = parents[:, i - 1]
        depth[:, i] = depth[rows, parent] + 1
        ancestors[:, i] |= ancestors[rows, parent]
    return depth, ancestors


class DraftBatchCache(KVCache):
    """The drafter's cache for a batch: context columns carry per-row validity, as the verifier's do.

    ``incoming`` [B, T] says which rows of the next context step are real (the rest pad rows that
    differ in count); chain keys are the tree nodes' ancestors, regathered by ``follow`` between steps.
    """

    valid: Tensor | None = None  # [B, S] context columns holding a real row
    incoming: Tensor | None = None  # [B, T] validity of the next context step's rows

    def add_context(self, k: Tensor, v: Tensor) -> Tensor:
        start = 0 if self.k is None else self.k.shape[2]
        super().add_context(k, v)
        self.valid = self.incoming if self.valid is None else torch.cat([self.valid, self.incoming], 1)
        columns = torch.arange(self.k.shape[2], device=k.device)
        causal = columns <= (start + torch.arange(k.shape[2], device=k.device))[:, None]  # [T, S]
        return (causal & self.valid[:, None, :])[:, None, None]  # [B, 1, 1, T, S]

    def add_chain(self, k: Tensor, v: Tensor, rows: Tensor) -> Tensor:
        super().add_chain(k, v, rows)
        return self.valid[:, None, None, None, :]  # [B, 1, 1, 1, S]: every real context row came before

    def keep_rows(self, rows: Tensor) -> None:
        """Keep only the batch rows ``rows`` [R] (``keep_rows`` of the verifier's side)."""
        for name in ("k", "v", "chain_k", "chain_v", "valid", "incoming"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])

    def follow(self, slots: Tensor) -> None:
        """Chain keys of row r := those of row slots[b, r] (a new frontier node continues its parent's path)."""
        if self.chain_k is None:  # a drafter that keeps no keys (test stand-ins)
            return
        pick = torch.arange(slots.shape[0], device=slots.device)[:, None], slots  # [B, R] each
        self.chain_k = self.chain_k.transpose(1, 2)[pick].transpose(1, 2)  # [B, nkv, R, J, hd]
        self.chain_v = self.chain_v.transpose(1, 2)[pick].transpose(1, 2)


class EagleProposer:
    """Chain or tree drafts of an EAGLE-3 drafter: SGLang's algorithm (the propose step in ``speculative``'s docstring)."""

    def __init__(self, drafter: nn.Module, shape: TreeShape, graphs=None):
        """``graphs``: a ``graphed.DecodeGraphs`` to draft in its static cache, every round's context step
        of num_steps + 1 rows (the longest path), as one captured graph after the prompt's."""
        self.drafter, self.shape, self.graphs = drafter, shape, graphs

    def start(self, prompts: Sequence[Tensor], batch: Batch, features: Tensor) -> None:
        """The prompt rows t = (g_t, x_{t+1}); the padded prefill layout, x_n = each row's root."""
        n = features.shape[1]
        ids = torch.stack([F.pad(p, (n - len(p), 0)) for p in prompts])  # [B, n]
        self.cache = DraftBatchCache() if self.graphs is None else self.graphs.draft_cache(len(prompts), self.shape)
        self.pending = (features, torch.cat([ids[:, 1:], batch.root[:, None]], 1), batch.positions[:, :n], batch.valid[:, :n])

    def advance(self, round_: Round) -> None:
        """Next context rows: the path's inputs with their features, each followed by the next emitted token."""
        width = max(len(p) for p in round_.paths) if self.graphs is None else self.shape.num_steps + 1
        B = len(round_.paths)
        device = round_.features.device
        index = torch.tensor([p + [p[-1]] * (width - len(p)) for p in round_.paths], device=device)  # [B, width]
        next_ids = torch.tensor([e + [e[-1]] * (width - len(e)) for e in round_.emitted], device=device)
        valid = torch.arange(width, device=device) < torch.tensor([len(p) for p in round_.paths], device=device)[:, None]
        features = round_.features[torch.arange(B, device=device)[:, None], index]  # [B, width, 3H]
        self.pending = (features, next_ids, round_.root_positions[:, None] + torch.arange(width, device=device), valid)

    def keep_rows(self, rows: Tensor) -> None:
        self.cache.keep_rows(rows)
        self.pending = tuple(x[rows] for x in self.pending)

    @torch.no_grad()
    def propose(self) -> Draft:
        if self.graphs is None:
            return self.draft(*self.pending)
        first = self.cache.columns == 0  # the prompt's context step: its length differs per batch, eager
        write_at = self.cache.next_columns(self.pending[1].shape[1], self.pending[1].device)
        if first:
            return self.draft(*self.pending)
        step = self.graphs.step(self.graphs.draft_key(self.drafter, self.shape, len(self.pending[1])), self.draft_tensors)
        tokens, parents, valid, depth, ancestors = step(*self.pending, write_at)
        draft = Draft(tokens, parents, valid)
        draft.__dict__["structure"] = depth, ancestors  # computed in the graph (``Draft.structure``'s cached value)
        return draft

    def draft_tensors(self, features: Tensor, next_ids: Tensor, positions: Tensor, valid: Tensor,
                      write_at: Tensor) -> tuple[Tensor, ...]:
        """``draft`` as the tensors a captured graph returns: (tokens, parents, valid, depth, ancestors)."""
        self.cache.write_at = write_at
        draft = self.draft(features, next_ids, positions, valid)
        return (draft.tokens, draft.parents, draft.valid, *draft.structure)

    def draft(self, features: Tensor, next_ids: Tensor, positions: Tensor, valid: Tensor) -> Draft:
        """The context step over the pending rows, then the tree's steps: the draft of every row."""
        drafter, (k, steps) = self.drafter, (self.shape.topk, self.shape.num_steps)
        self.cache.incoming = valid
        h2 = drafter.step(next_ids, drafter.fc(features), positions, self.cache)  # [B, T, H]
        B, _, H = h2.shape
        rows = torch.arange(B, device=h2.device)
        last = valid.long().cumsum(1).argmax(1)  # [B] the last real row continues into the tree
        hidden, position = h2[rows, last][:, None], positions[rows, last]  # [B, 1, H], [B]
        scores, tokens = F.log_softmax(drafter.logits(hidden).float(), -1).topk(k, -1)  # [B, 1, k]
        scores, tokens = scores[:, 0], tokens[:, 0]  # [B, k] the root's children
        frontier, parents = torch.arange(k, device=h2.device).expand(B, k), torch.full((B, k), -1, device=h2.device)
        all_scores, all_tokens, all_parents = [scores], [tokens], [parents]
        front_scores, front_tokens, hidden = scores, tokens, hidden.expand(B, k, H)
        for step in range(1, steps):
            h2 = drafter.step(self.to_target(front_tokens), hidden, (position + step)[:, None].expand(B, k), self.cache,
                              rows=torch.arange(k, device=h2.device))  # [B, k, H]
            child_scores, child_tokens = F.log_softmax(drafter.logits(h2).float(), -1).topk(k, -1)  # [B, k, k]
            child_scores = front_scores[:, :, None] + child_scores  # cumulative log-probability
            offset = sum(s.shape[1] for s in all_scores)
            all_scores.append(child_scores.flatten(1))
            all_tokens.append(child_tokens.flatten(1))
            all_parents.append(frontier[:, :, None].expand(B, k, k).flatten(1))
            front_scores, pick = child_scores.flatten(1).topk(k, -1)  # [B, k] the next frontier
            slots = pick // k  # which frontier node each continues
            frontier, front_tokens = offset + pick, child_tokens.flatten(1).gather(1, pick)
            hidden = h2.gather(1, slots[:, :, None].expand(B, k, H))
            if step < steps - 1:
                self.cache.follow(slots)
        return self.select(torch.cat(all_scores, 1), torch.cat(all_tokens, 1), torch.cat(all_parents, 1))

    def select(self, scores: Tensor, tokens: Tensor, parents: Tensor) -> Draft:
        """The best num_draft_tokens - 1 nodes, in creation order (parents first).

        A child's score is its parent's plus a log-probability <= 0, and the stable sort keeps the
        earlier-created parent first on ties, so every chosen node's parent is chosen too.
        """
        B, total = scores.shape
        best = scores.sort(dim=1, descending=True, stable=True).indices[:, : self.shape.num_draft_tokens - 1]
        chosen = best.sort(1).values  # [B, N]
        block = torch.full((B, total), -1, device=scores.device)
        block.scatter_(1, chosen, torch.arange(1, chosen.shape[1] + 1, device=scores.device).expand_as(chosen))
        parent = parents.gather(1, chosen)  # candidate index, -1: the root
        parent_block = torch.where(parent < 0, 0, block.gather(1, parent.clamp(min=0)))
        return Draft(self.to_target(tokens.gather(1, chosen)), parent_block, torch.ones_like(chosen, dtype=torch.bool))

    def to_target(self, draft_ids: Tensor) -> Tensor:
        """Target ids of draft-vocabulary ids: target = draft + d2t[draft]."""
        return draft_ids + self.drafter.d2t[draft_ids]
