"""Speculative decoding of the verifier, several prompts at once: prefill -> propose -> verify -> accept.

    plain = greedy_decode(verifier, prompts, max_new_tokens=64, eos_ids={2})       # token lists
    tree = EagleProposer(drafter, TreeShape(num_steps=5, topk=4, num_draft_tokens=16))   # eagle3.decoding.tree
    target = Target(verifier=verifier, layer_ids=(2, 15, 27), eos_ids={2})
    out = speculative_decode(target, tree, prompts, max_new_tokens=64)
    assert [d.tokens for d in out] == plain     # greedy verification is lossless
    out[0].accepted                             # drafts accepted per verifier forward; τ = accepted + 1

Why: the ``evaluate`` stage measures a drafter by really decoding with it, the way SGLang's EAGLE-3
worker does (chain or tree drafting, greedy verification, KV caches on both models), so a broken
export shows up as τ ≈ 1 instead of as a plausible training loss. Prompts are decoded in a batch:
one-token forwards of a small verifier are launch-bound on a GPU and memory-bound on a CPU, so B
rows cost little more than one. The batch's caches and masks, whatever each row accepted, are
``eagle3.decoding.batch``'s; the drafts are a proposer's (``eagle3.decoding.tree``).

Bookkeeping for a prompt x_0..x_{n-1}; g_t = the verifier's tapped features at input x_t (the
residual streams entering the drafter's aux layers, HF ``hidden_states[k]``, concatenated):

- ``prefill``: verifier over x_0..x_{n-1} (left-padded to the batch's longest prompt); its greedy
  token x_n is the first output token (the root of the first round).
- propose (``EagleProposer``): drafter context step over the new rows t, row t = (g_t, x_{t+1}) at
  RoPE position t (the training alignment: (g_t, x_{t+1}) predicts x_{t+2}); the last row's top-k
  tokens are the first draft nodes. Each further step feeds the k best nodes so far (by cumulative
  draft log-probability) with their parent's pre-norm h2 at position n + depth - 1 and expands each
  into its top-k children; the best ``num_draft_tokens - 1`` nodes of all form the tree (SGLang's
  EAGLE algorithm; topk = 1 is the chain of K = num_steps drafts).
- ``verify``: one verifier forward over [root, nodes...], each node at position n + depth and seeing
  the row's valid columns and its own ancestors (a 4D mask): greedy y for every node acceptance reads.
- ``accept``: from the root, move to the child whose token equals the current node's greedy token,
  while there is one; the path's drafts are accepted and the last node's greedy token is the bonus.
  Only the path's columns become valid; the drafter's next context step covers the path's rows.

Worked example, chain, n = 5, K = 3, j = 1 accepted: verify feeds positions 5..8 = [x_5, d_1, d_2,
d_3]; y_0 == d_1, y_1 != d_2, so the output grows by [d_1, y_1]; columns of x_5 and d_1 become valid,
those of d_2, d_3 stay invalid; the next context step covers rows 5, 6 = (g(x_5), d_1), (g(d_1), y_1)
at positions 5, 6, and the drafts continue at positions 7, 8, ...

A row ends at EOS, at max_new_tokens, or after one of ``model.stop``'s strings (``StopStrings``).
On a GPU, ``eagle3.decoding.graphed`` runs the same loop over static caches with CUDA-graph-captured
steps (``graphs=``): rows then stay in the batch and rejected columns stay masked, not removed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.decoding.batch import Batch, drop_rejected, forward_verifier, keep_rows, new_cache
from eagle3.decoding.tree import Draft, Round


@dataclass
class Decoded:
    """The output of one speculative decode."""

    tokens: list[int]  # generated tokens after the prompt, up to and including EOS, at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # per verifier forward after prefill: drafts accepted
    stopped: bool = False  # ended by a stop string (its last token completes it; ``StopStrings``)
    paused: bool = False  # left at ``Pause.at`` tokens, unfinished: a later decode may go on from it


@dataclass(frozen=True)
class Pause:
    """Where a decode leaves its rows unfinished, and where an earlier decode left them (``speculative_decode``)."""

    at: int  # a row leaves once it has this many tokens, after the round that reached them
    answered: Sequence[list[int]] | None = None  # per prompt, the tokens an earlier decode paused at; None: a new decode


@dataclass(frozen=True)
class Target:
    """What a decode runs and where its answers end: the verifier, the layers whose features it taps
    (the drafter's ``aux_layers``), its EOS ids, ``model.stop``'s strings and, on a GPU, the graphs
    (``graphed.DecodeGraphs``, the proposer made with the same ones; None: eager)."""

    verifier: Any
    layer_ids: Sequence[int]
    eos_ids: set[int]
    stops: StopStrings | None = None
    graphs: Any = None


# --- the ladder: prefill, verify, accept, commit ---------------------------------------------------


@torch.no_grad()
def prefill(verifier, prompts: Sequence[Tensor], layer_ids: Sequence[int]) -> tuple[Batch, Tensor]:
    """Verifier over the prompts [n_b] each, left-padded to the longest: (batch, features [B, n, 3H]).

    Example, prompts of 3 and 5 tokens: row 0 is [pad, pad, a0, a1, a2] at positions [0, 0, 0, 1, 2];
    column 4 holds each row's last prompt token, so one logit per row gives the first output token.
    """
    n = max(len(p) for p in prompts)
    device = prompts[0].device
    pad = torch.tensor([n - len(p) for p in prompts], device=device)  # [B]
    ids = torch.stack([F.pad(p, (n - len(p), 0)) for p in prompts])  # [B, n]
    columns = torch.arange(n, device=device)
    valid = columns >= pad[:, None]  # [B, n]
    positions = (columns - pad[:, None]).clamp(min=0)
    batch = Batch(cache=new_cache(), valid=valid[:, :0], positions=positions[:, :0], root=ids[:, -1], length=pad.new_zeros(len(prompts)))
    causal = (columns[None, :] <= columns[:, None]) & valid[:, None, :]  # [B, n, n]: no cache column to see yet
    hidden, features = forward_verifier(verifier, batch, ids, positions, causal, layer_ids)
    batch.valid, batch.root, batch.length = valid, verifier.get_output_embeddings()(hidden[:, -1]).argmax(-1), positions[:, -1] + 1
    return batch, features


@torch.no_grad()
def verify(verifier, batch: Batch, draft: Draft, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """One verifier forward over [root, nodes...] of every row: (greedy [B, 1 + N] where acceptance reads it,
    features [B, 1 + N, 3H])."""
    depth, ancestors = draft.structure
    input_ids = torch.cat([batch.root[:, None], draft.tokens], 1)  # [B, 1 + N]
    see_cache = batch.valid[:, None, :].expand(-1, input_ids.shape[1], -1)  # [B, 1 + N, S]
    visible = torch.cat([see_cache, ancestors], -1)  # [B, 1 + N, S + 1 + N]
    hidden, features = forward_verifier(verifier, batch, input_ids, batch.length[:, None] + depth, visible, layer_ids)
    return greedy_tokens(verifier, hidden, draft), features


def greedy_tokens(verifier, hidden: Tensor, draft: Draft) -> Tensor:
    """The verifier's greedy token [B, 1 + N] at every block column acceptance can reach; -1 at the others.

    Why: the lm_head (the whole vocabulary) is a small verifier's largest matrix, and greedy
    verification reads the greedy tokens of the root and of nodes that carry their parent's greedy
    token only. On the CPU, where a few-row matmul costs about one reading of the matrix, those are
    computed depth by depth (the root, then at τ ≈ 1 hardly any node): 16-token trees of two
    prompts spend a quarter of their verify time in the lm_head otherwise. On a GPU every column
    in one matmul, with no host sync. Example, chain [root, 5, 6]: root's greedy 5, node 1's 7 ->
    [5, 7, -1] (node 2 carries 6, not 7: never reached).
    """
    head = verifier.get_output_embeddings()
    if hidden.device.type != "cpu":
        return head(hidden).argmax(-1)
    depth = draft.structure[0]  # [B, 1 + N]
    greedy = torch.full(depth.shape, -1, dtype=torch.long)
    reached = depth == 0  # the root
    for level in range(int(depth.max()) + 1):
        rows, columns = (reached & (depth == level)).nonzero(as_tuple=True)
        if not len(rows):
            break
        greedy[rows, columns] = head(hidden[rows, columns]).argmax(-1)
        reached = F.pad(draft.valid & (draft.tokens == greedy.gather(1, draft.parents)), (1, 0), value=True)
    return greedy


def accept(draft: Draft, greedy: Tensor, budgets: Tensor, eos_ids: Tensor) -> Tensor:
    """Per row, the accepted path as a mask over block indices [B, 1 + N] (the root always on it).

    Acceptance rule (greedy verification): from the root, a node is accepted iff it is a valid
    child of the last accepted node and its token equals that node's greedy token; then its own
    greedy token is the next one to match. The last accepted node's greedy token is the bonus, so a
    forward yields as many tokens as the path has nodes, all exactly greedy ones. A row stops
    accepting once it has ``budgets[b]`` [B] tokens or has produced an EOS (``eos_ids`` [E]), as a
    server would: a node at depth d needs d < budget and its parent's greedy token not an EOS.

    In tensor ops over the whole batch (no per-row loop, no host sync): a node matches on its own
    terms, it is on the path iff it and all its drafted ancestors match, and the path is the
    ancestors of the deepest such node (siblings differ, so there is one).
    """
    depth, ancestors = draft.structure
    wanted = greedy.gather(1, draft.parents)  # [B, N] the parent's greedy token
    match = draft.valid & (draft.tokens == wanted) & ~torch.isin(wanted, eos_ids) & (depth[:, 1:] < budgets[:, None])
    on_path = ~(ancestors[:, 1:, 1:] & ~match[:, None, :]).any(-1)  # [B, N]: every drafted ancestor-or-self matches
    reach = depth * F.pad(on_path, (1, 0))  # [B, 1 + N]; the root (depth 0) when no node is on the path
    last = reach.argmax(1)  # [B] the deepest, the first on ties
    return ancestors[torch.arange(len(last), device=last.device), last]


def commit(batch: Batch, path: Tensor, greedy: Tensor) -> None:
    """Make the accepted columns valid (path [B, 1 + N]); the bonus token becomes each row's root."""
    Q = path.shape[1]
    batch.valid[:, -Q:] = path
    last = (path * torch.arange(Q, device=path.device)).argmax(1)  # [B] the path's last node (block order = depth order)
    batch.root = greedy[torch.arange(len(last), device=last.device), last]
    batch.length = batch.length + path.sum(1)


# --- decoding --------------------------------------------------------------------------------------


class StopStrings:
    """The end of an answer at one of ``model.stop``'s strings (a base model's end-of-turn text), as
    generation stops there (transformers' ``stop_strings``, a server's ``stop``).

    Tokens are matched as text, since a string may span tokens and one token may hold more than it.
    The answer keeps the token that completes the string, as it keeps an EOS. Example, stop "\nUser:"
    and tokens decoding to ["4", ".", "\n", "User", ":", " and"]: the first 5 are kept.
    """

    def __init__(self, tokenizer, strings: Sequence[str]):
        self.tokenizer, self.strings = tokenizer, tuple(strings)

    def ends(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return any(stop in text for stop in self.strings)

    def keep(self, tokens: list[int], new: int) -> int | None:
        """How many of ``tokens`` (the last ``new`` just generated) to keep: up to the first stop string; None: none yet."""
        if not self.ends(tokens):
            return None
        return next(n for n in range(len(tokens) - new + 1, len(tokens) + 1) if self.ends(tokens[:n]))


def end_at_stop(output: Decoded, new: int, stops: StopStrings | None) -> int:
    """Cut ``output`` after a stop string its ``new`` last tokens complete; returns how many tokens went."""
    keep = None if stops is None else stops.keep(output.tokens, new)
    if keep is None:
        return 0
    cut = len(output.tokens) - keep
    del output.tokens[keep:]
    output.stopped = True
    return cut


def truncate(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Tokens up to and including the first EOS, at most ``max_new_tokens``: what greedy decoding emits."""
    tokens = tokens[:max_new_tokens]
    ends = [i for i, token in enumerate(tokens) if token in eos_ids]
    return tokens[: ends[0] + 1] if ends else tokens


def finished(output: Decoded, max_new_tokens: int, eos_ids: set[int]) -> bool:
    tokens = output.tokens
    return output.stopped or len(tokens) >= max_new_tokens or (bool(tokens) and tokens[-1] in eos_ids)


@torch.no_grad()
def speculative_decode(target: Target, proposer, prompts: Sequence[Tensor], max_new_tokens: int,
                       prefilled: tuple[Batch, Tensor] | None = None, pause: Pause | None = None) -> list[Decoded]:
    """Greedy decoding of ``target``'s verifier from each prompt [n_b], sped up by ``proposer``'s drafts (None: plain).

    ``prefilled``: ``prefill``'s result for these prompts, to decode several ways from one prefill
    (it is copied, never changed). With ``target.graphs`` the decode runs in their static caches
    and captured steps; the tokens are the same. A row ends at EOS, at ``max_new_tokens`` or after
    a stop string (``target.stops``); a forward whose tokens run past a stop string counts the
    drafts it accepted up to there.

    ``pause.at``: a row also leaves once it has that many tokens, after the round that reached them (never
    cut short: its acceptance is as if it went on), marked ``paused``. ``pause.answered``: per prompt, the
    tokens an earlier decode paused at; each prompt then ends with all of them but the last (the bonus token
    that decode's last round emitted, which becomes the root, as it would have), and decoding goes on from
    there: its tokens are the whole answer, its ``accepted`` this decode's forwards only. Example, a paused
    answer [5, 7, 9] of prompt p: prompt p + [5, 7], answered [5, 7, 9]; the first forward verifies 9 and its drafts.
    """
    verifier, layer_ids, eos_ids, graphs, stops = target.verifier, target.layer_ids, target.eos_ids, target.graphs, target.stops
    batch, features = prefilled if prefilled else prefill(verifier, prompts, layer_ids)
    if graphs is None:
        batch = copy.deepcopy(batch) if prefilled else batch
    else:
        batch = graphs.static_batch(batch, 1 if proposer is None else proposer.shape.num_draft_tokens)
    answered = pause.answered if pause else None
    if answered is None:
        outputs = [Decoded([int(t)]) for t in batch.root]
        for output in outputs:
            end_at_stop(output, 1, stops)
    else:  # the last answered token is the root, whatever this prefill's own greedy token (equal, but for rounding)
        outputs = [Decoded(list(tokens)) for tokens in answered]
        batch.root = torch.tensor([tokens[-1] for tokens in answered], device=batch.root.device)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=batch.root.device)

    def leaves(output: Decoded) -> bool:
        output.paused = pause is not None and len(output.tokens) >= pause.at and not finished(output, max_new_tokens, eos_ids)
        return output.paused or finished(output, max_new_tokens, eos_ids)

    if proposer is not None:
        proposer.start(prompts, batch, features)
    live = retire(list(range(len(outputs))), outputs, batch, proposer, leaves)  # the batch's rows
    while live:
        # before any kernel of the round is queued: a host-to-device copy waits for the GPU's queue
        budgets = torch.tensor([max_new_tokens - len(outputs[i].tokens) for i in live], device=eos.device)  # [B]
        draft = proposer.propose() if proposer is not None else no_draft(batch)
        root_positions, inputs = batch.length, torch.cat([batch.root[:, None], draft.tokens], 1)  # [B], [B, Q]
        greedy, features = verify(verifier, batch, draft, layer_ids)
        path = accept(draft, greedy, budgets, eos)  # [B, Q]
        commit(batch, path, greedy)
        paths, emitted = read_round(inputs, path, batch.root)
        if graphs is None:
            drop_rejected(batch, inputs.shape[1], torch.tensor(sorted(set().union(*paths)), device=greedy.device))
        for i, row_path, new in zip(live, paths, emitted):
            if leaves(outputs[i]):
                continue  # a static batch's finished row, still riding along
            outputs[i].tokens += new
            outputs[i].accepted.append(len(row_path) - 1 - end_at_stop(outputs[i], len(new), stops))
        if proposer is not None:
            proposer.advance(Round(paths, emitted, features, root_positions))
        live = retire(live, outputs, batch, proposer, leaves)
    return [Decoded(truncate(o.tokens, max_new_tokens, eos_ids), o.accepted, o.stopped, o.paused) for o in outputs]


def retire(live: list[int], outputs: list[Decoded], batch: Batch, proposer, leaves: Callable[[Decoded], bool]) -> list[int]:
    """The batch rows ``live`` (indices into ``outputs``) that still decode (``leaves`` says which go); the others
    leave the batch and the proposer's state (``keep_rows``). A static batch (``Batch.graphs``) keeps its
    rows until all have gone: its graphs are of a fixed row count."""
    still = [r for r, i in enumerate(live) if not leaves(outputs[i])]
    if batch.graphs is not None:
        return live if still else []
    if len(still) < len(live):
        rows = torch.tensor(still, dtype=torch.long, device=batch.root.device)
        keep_rows(batch, rows)
        if proposer is not None:
            proposer.keep_rows(rows)
    return [live[r] for r in still]


def read_round(inputs: Tensor, path: Tensor, bonus: Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """(paths as block indices, emitted tokens) per row, from the block [B, Q], its path mask and the bonus [B].

    The round's one host transfer: everything the outputs and the proposers' bookkeeping need.
    Example: inputs [[9, 5, 6]], path [[1, 1, 0]], bonus [7] -> ([[0, 1]], [[5, 7]]).
    """
    Q = inputs.shape[1]
    rows = torch.cat([inputs, path.long(), bonus[:, None]], 1).tolist()  # [B, 2Q + 1]
    paths = [[i for i in range(Q) if row[Q + i]] for row in rows]
    return paths, [[row[i] for i in p[1:]] + [row[-1]] for row, p in zip(rows, paths)]


def no_draft(batch: Batch) -> Draft:
    empty = batch.root.new_zeros(len(batch.root), 0)
    return Draft(empty, empty, empty.bool())


def greedy_decode(verifier, prompts: Sequence[Tensor], max_new_tokens: int, eos_ids: set[int],
                  stops: StopStrings | None = None) -> list[list[int]]:
    """Plain greedy decoding, one verifier forward per token (the reference and the speed baseline)."""
    target = Target(verifier=verifier, layer_ids=(0,), eos_ids=eos_ids, stops=stops)
    return [d.tokens for d in speculative_decode(target, None, prompts, max_new_tokens)]
