"""Speculative decoding of the verifier, several prompts at once: prefill -> propose -> verify -> accept.

    plain = greedy_decode(verifier, prompts, max_new_tokens=64, eos_ids={2})       # token lists
    chain = EagleProposer(drafter, TreeShape.chain(7))                            # K = 7 chain drafts
    tree = EagleProposer(drafter, TreeShape(num_steps=5, topk=4, num_draft_tokens=16))   # SGLang's tree
    out = speculative_decode(verifier, tree, prompts, layer_ids=(2, 15, 27), max_new_tokens=64, eos_ids={2})
    assert [d.tokens for d in out] == plain     # greedy verification is lossless
    out[0].accepted                             # drafts accepted per verifier forward; τ = accepted + 1

Why: the ``evaluate`` stage measures a drafter by really decoding with it, the way SGLang's EAGLE-3
worker does (chain or tree drafting, greedy verification, KV caches on both models), so a broken
export shows up as τ ≈ 1 instead of as a plausible training loss. Prompts are decoded in a batch:
one-token forwards of a small verifier are launch-bound on a GPU and memory-bound on a CPU, so B
rows cost little more than one.

The batch and its holes. Both caches only grow: every forward appends its columns for every row,
and a bool per column says whether it holds an accepted token of that row (``Batch.valid``; not
padding, not a rejected draft). Attention masks are built from it, so nothing is ever cropped or
reordered, whatever each row accepted, and sliding-window layers stay exact (their window is a
distance between positions, applied in the mask). Each column also records its position in its
sequence; RoPE and the window use positions, never column indices.

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
On a GPU, ``eagle3.drafter.graphed`` runs the same loop over static caches with CUDA-graph-captured
steps (``graphs=``): rows then stay in the batch and rejected columns stay masked, not removed.

The drafter interface is that of ``Eagle3Drafter``: ``fc`` (features [B, T, 3H] -> hidden),
``step(input_ids, hidden, position_ids, cache, rows) -> h2``, ``logits(h2) -> [..., Vd]`` and ``d2t``.
History-only proposers (the baselines: ``most_frequent``, ``ngram``) propose from the tokens alone.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache

from eagle3.drafter.attention import KVCache
from eagle3.verifiers.spec import tapped_features


@dataclass
class Decoded:
    """The output of one speculative decode."""

    tokens: list[int]  # generated tokens after the prompt, up to and including EOS, at most max_new_tokens
    accepted: list[int] = field(default_factory=list)  # per verifier forward after prefill: drafts accepted
    stopped: bool = False  # ended by a stop string (its last token completes it; ``StopStrings``)


@dataclass(frozen=True)
class TreeShape:
    """SGLang's draft-tree flags: --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens."""

    num_steps: int  # drafter steps = the deepest draft
    topk: int  # children kept per expanded node, and nodes expanded per step
    num_draft_tokens: int  # tokens per verifier forward: the root plus num_draft_tokens - 1 drafts

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(num_steps=k, topk=1, num_draft_tokens=k + 1)


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
class Batch:
    """The verifier's side of a batch: its KV cache and what each column holds."""

    cache: DynamicCache
    valid: Tensor  # [B, S] bool: the column holds an accepted token of this row
    positions: Tensor  # [B, S] position of each column in its row's sequence
    root: Tensor  # [B] the last verified token, input of the next forward
    length: Tensor  # [B] the root's position
    graphs: object = None  # ``graphed.DecodeGraphs`` when the cache is its static one (rows and columns never leave)


@dataclass
class Round:
    """What one verifier forward decided, for the proposers."""

    paths: list[list[int]]  # per row: accepted block indices, the root (0) first
    emitted: list[list[int]]  # per row: tokens this round adds (accepted drafts, then the bonus)
    features: Tensor  # [B, 1 + N, 3H] verifier features at the block's inputs
    root_positions: Tensor  # [B] position of block index 0


# --- the verifier side ------------------------------------------------------------------------------


def cache_kwargs(verifier, cache: DynamicCache) -> dict:
    """The KV-cache arguments of the verifier's forward: ``cache`` in recent transformers 5, else (older 5.x,
    remote code) ``past_key_values``."""
    name = "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


SKINNY_ROWS = 16  # rows (batch x block tokens) below which ``skinny_matmuls`` multiplies the other way round


def skinny_matmuls(model: nn.Module) -> nn.Module:
    """Make the model's ``nn.Linear`` layers compute ``(W @ x^T)^T`` for inputs of fewer than SKINNY_ROWS rows.

    Why: decoding feeds the verifier a few rows at a time, and on the CPU MKL's ``x @ W^T`` (what
    ``F.linear`` calls) with 2-8 rows runs at a third of the memory bandwidth that reading the
    weights once needs, while ``W @ x^T`` runs at nearly all of it: SmolLM2-135M fp32 on one core,
    all 211 matrices times 2 rows, 137 ms vs 52 ms; plain decoding of two prompts 6.3 vs 3.2 CPU s.
    From 16 rows on (chain and tree verify forwards) ``F.linear`` is as fast or faster and is kept.
    The model is changed in place (each layer's ``forward``) and returned.
    """
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = functools.partial(skinny_linear, module)
    return model


def skinny_linear(module: nn.Linear, x: Tensor) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if rows.shape[0] >= SKINNY_ROWS:
        return F.linear(x, module.weight, module.bias)
    out = torch.mm(module.weight, rows.t()).t().contiguous()  # [M, N]
    if module.bias is not None:
        out = out + module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def new_cache() -> DynamicCache:
    """A verifier KV cache that keeps every column of every layer.

    ``DynamicCache(config=...)`` gives sliding-window layers (Mistral, hybrid families) a cache that
    keeps only the last window - 1 keys: it cannot hold columns that later turn out rejected, and
    transformers refuses to crop it once the window is full. Without a config every layer keeps all
    its columns; a sliding layer still sees only its window, through the masks of ``attention_masks``.
    """
    return DynamicCache()


def sliding_windows(config) -> dict[str | None, int | None]:
    """Window per mask the verifier's forward takes: {None: w} for one mask, {layer type: w} for several.

    Hybrid families (``layer_types`` with sliding and full layers) take a dict of masks keyed by
    layer type; the others one mask, windowed when ``sliding_window`` applies to every layer.
    """
    config = config.get_text_config()
    types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if len(types) > 1:
        return {kind: window if kind == "sliding_attention" else None for kind in types}
    if types and types != {"sliding_attention"}:
        window = None  # e.g. Qwen2: sliding_window set, every layer full
    return {None: window}


def attention_masks(config, see_cache: Tensor, cache_positions: Tensor, block: Tensor, block_positions: Tensor,
                    dtype: torch.dtype):
    """Additive masks [B, 1, Q, S + Q] of a forward over Q new columns: the attention_mask argument.

    see_cache [B, Q, S] (which valid cache columns each query may see), block [B, Q, Q] (which new
    columns: causal, or ancestors in a tree), positions [B, S] and [B, Q] for the windows.
    """
    visible = torch.cat([see_cache, block], -1)  # [B, Q, S + Q]
    distance = block_positions[:, :, None] - torch.cat([cache_positions, block_positions], 1)[:, None, :]
    masks = {}
    for kind, window in sliding_windows(config).items():
        seen = visible & (distance < window) if window else visible
        masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)[:, None]
    return masks.pop(None) if None in masks else masks


def forward_verifier(verifier, batch: Batch, input_ids: Tensor, positions: Tensor, block: Tensor, see_cache: Tensor,
                     layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The verifier's decoder over input_ids [B, Q] appended to the batch's cache: (last hidden states [B, Q, H],
    the lm_head's input; features [B, Q, 3H]).

    The lm_head is left to the caller, which needs it for a few columns only (``greedy_tokens``).
    The new columns are recorded as not (yet) valid.
    """
    decoder = verifier.base_model
    dtype = verifier.get_input_embeddings().weight.dtype
    masks = attention_masks(verifier.config, see_cache, batch.positions, block, positions, dtype)
    if batch.graphs is not None:
        hidden, features = batch.graphs.verifier_forward(decoder, batch.cache, input_ids, positions, masks, layer_ids)
    else:
        hidden, features = decoder_forward(decoder, batch.cache, input_ids, positions, masks, layer_ids)
    batch.valid = torch.cat([batch.valid, torch.zeros_like(input_ids, dtype=torch.bool)], 1)
    batch.positions = torch.cat([batch.positions, positions], 1)
    return hidden, features


def decoder_forward(decoder, cache, input_ids: Tensor, positions: Tensor, masks, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """The verifier's decoder over input_ids [B, Q] on ``cache``: (last hidden states [B, Q, H], features [B, Q, 3H])."""
    out = decoder(input_ids=input_ids, position_ids=positions, attention_mask=masks, output_hidden_states=True,
                  **cache_kwargs(decoder, cache))
    return out.last_hidden_state, tapped_features(out.hidden_states, layer_ids)


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
    batch = Batch(new_cache(), valid[:, :0], positions[:, :0], ids[:, -1], pad.new_zeros(len(prompts)))
    causal = (columns[None, :] <= columns[:, None]) & valid[:, None, :]  # [B, n, n]
    hidden, features = forward_verifier(verifier, batch, ids, positions, causal, causal[:, :, :0], layer_ids)
    batch.valid, batch.root, batch.length = valid, verifier.get_output_embeddings()(hidden[:, -1]).argmax(-1), positions[:, -1] + 1
    return batch, features


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


@torch.no_grad()
def verify(verifier, batch: Batch, draft: Draft, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """One verifier forward over [root, nodes...] of every row: (greedy [B, 1 + N] where acceptance reads it,
    features [B, 1 + N, 3H])."""
    depth, ancestors = draft.structure
    input_ids = torch.cat([batch.root[:, None], draft.tokens], 1)  # [B, 1 + N]
    see_cache = batch.valid[:, None, :].expand(-1, input_ids.shape[1], -1)  # [B, 1 + N, S]
    hidden, features = forward_verifier(verifier, batch, input_ids, batch.length[:, None] + depth, ancestors, see_cache, layer_ids)
    return greedy_tokens(verifier, hidden, draft), features


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


def drop_rejected(batch: Batch, block: int, kept: Tensor) -> None:
    """Remove the last ``block`` columns that no row accepted; ``kept`` [n]: the others' block indices, ascending.

    Why: such a column is masked out of every later forward, yet attention, its mask and the
    cache's growth pay for it in each one; with 16-token trees at τ ≈ 1 the cache would be mostly
    such columns by the 64th token. The kept columns move down in place (no copy of the whole
    cache) and every layer's cache is cut to length, as ``DynamicCache.crop`` does.
    """
    start, n = batch.valid.shape[1] - block, len(kept)
    if n == block:
        return
    index = start + kept

    def keep(x: Tensor) -> Tensor:  # [..., S, d] or [B, S]
        dim = -2 if x.dim() > 2 else -1
        x.narrow(dim, start, n).copy_(x.index_select(dim, index))
        return x.narrow(dim, 0, start + n)

    for layer in batch.cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = keep(layer.keys), keep(layer.values)
    batch.valid, batch.positions = keep(batch.valid), keep(batch.positions)


def keep_rows(batch: Batch, rows: Tensor) -> None:
    """Keep only ``rows`` [R] of the batch (the others finished): every layer's cache and the column records.

    Why: a finished prompt would otherwise ride along in every later forward; on a CPU, where the
    verify forwards of a few rows are compute-bound, a batch whose prompts stop at 10 and 64 tokens
    pays for both rows until the end.
    """
    for layer in batch.cache.layers:
        if layer.keys is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]
    batch.valid, batch.positions, batch.root, batch.length = (x[rows] for x in (batch.valid, batch.positions, batch.root, batch.length))


# --- proposers --------------------------------------------------------------------------------------


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
    """Chain or tree drafts of an EAGLE-3 drafter (SGLang's algorithm; see the module docstring)."""

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


def most_frequent(token: int) -> Callable[[list[int], int], list[int]]:
    """The context-free baseline: always ``k`` times the same token."""
    return lambda history, k: [token] * k


def ngram(history: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup (vLLM's and SGLang's ``ngram``): what followed the latest earlier match of the last n tokens.

    n from ``max_n`` down to 1, the longest matching suffix first, its most recent earlier occurrence;
    up to ``k`` tokens, none without a match. Example: history [5, 6, 7, 1, 5, 6], k = 2 -> [7, 1].
    """
    for n in range(min(max_n, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + k]
    return []


class HistoryProposer:
    """A chain of up to K drafts from each row's tokens so far (prompt + output), e.g. ``ngram``."""

    def __init__(self, propose: Callable[[list[int], int], list[int]], k: int):
        self.propose_fn, self.k = propose, k

    def start(self, prompts: Sequence[Tensor], batch: Batch, features: Tensor) -> None:
        self.histories = [p.tolist() + [int(r)] for p, r in zip(prompts, batch.root)]
        self.device = batch.root.device

    def advance(self, round_: Round) -> None:
        for history, emitted in zip(self.histories, round_.emitted):
            history += emitted

    def keep_rows(self, rows: Tensor) -> None:
        self.histories = [self.histories[r] for r in rows.tolist()]

    def propose(self) -> Draft:
        proposals = [self.propose_fn(h, self.k)[: self.k] for h in self.histories]
        tokens = torch.tensor([p + [0] * (self.k - len(p)) for p in proposals], device=self.device)  # [B, K]
        valid = torch.arange(self.k, device=self.device) < torch.tensor([len(p) for p in proposals], device=self.device)[:, None]
        parents = torch.arange(self.k, device=self.device).expand_as(tokens)  # a chain
        return Draft(tokens, parents, valid)


# --- decoding -------------------------------------------------------------------------------------


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
def speculative_decode(verifier, proposer, prompts: Sequence[Tensor], layer_ids: Sequence[int], max_new_tokens: int,
                       eos_ids: set[int], prefilled: tuple[Batch, Tensor] | None = None, graphs=None,
                       stops: StopStrings | None = None) -> list[Decoded]:
    """Greedy decoding of ``verifier`` from each prompt [n_b], sped up by ``proposer``'s drafts (None: plain).

    ``prefilled``: ``prefill``'s result for these prompts, to decode several ways from one prefill
    (it is copied, never changed). ``graphs``: a ``graphed.DecodeGraphs`` to decode in its static
    caches and captured steps (the proposer made with the same one); the tokens are the same.
    A row ends at EOS, at ``max_new_tokens`` or after a stop string (``stops``); a forward whose
    tokens run past a stop string counts the drafts it accepted up to there.
    """
    batch, features = prefilled if prefilled else prefill(verifier, prompts, layer_ids)
    if graphs is None:
        batch = copy.deepcopy(batch) if prefilled else batch
    else:
        batch = graphs.static_batch(batch, 1 if proposer is None else proposer.shape.num_draft_tokens)
    outputs = [Decoded([int(t)]) for t in batch.root]
    for output in outputs:
        end_at_stop(output, 1, stops)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=batch.root.device)
    if proposer is not None:
        proposer.start(prompts, batch, features)
    live = retire(list(range(len(outputs))), outputs, batch, proposer, max_new_tokens, eos_ids)  # the batch's rows
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
            if finished(outputs[i], max_new_tokens, eos_ids):
                continue  # a static batch's finished row, still riding along
            outputs[i].tokens += new
            outputs[i].accepted.append(len(row_path) - 1 - end_at_stop(outputs[i], len(new), stops))
        if proposer is not None:
            proposer.advance(Round(paths, emitted, features, root_positions))
        live = retire(live, outputs, batch, proposer, max_new_tokens, eos_ids)
    return [Decoded(truncate(o.tokens, max_new_tokens, eos_ids), o.accepted, o.stopped) for o in outputs]


def retire(live: list[int], outputs: list[Decoded], batch: Batch, proposer, max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The batch rows ``live`` (indices into ``outputs``) that still decode; the finished ones leave
    the batch and the proposer's state (``keep_rows``). A static batch (``Batch.graphs``) keeps its
    rows until all have finished: its graphs are of a fixed row count."""
    still = [r for r, i in enumerate(live) if not finished(outputs[i], max_new_tokens, eos_ids)]
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
    return [d.tokens for d in speculative_decode(verifier, None, prompts, (0,), max_new_tokens, eos_ids, stops=stops)]


def replay(propose: Callable[[list[int], int], list[int]], prompt: list[int], output: list[int], k: int,
           drafted_only: bool = False) -> list[int]:
    """Drafts accepted per verifier forward had a history proposer decoded ``output`` (the plain greedy output);
    ``drafted_only``: of the forwards it proposed drafts for (prompt lookup finds no match in some).

    Exact without running the verifier: under greedy verification every forward's greedy tokens are
    the output's, and decoding stops accepting at the output's end (its budget or EOS), as
    ``accept`` does. Example: output [4, 5, 6, 7], drafts always [5, 6]: forward 1 at [4] accepts
    5, 6 (then bonus 7): [2].
    """
    accepted, done = [], 1  # prefill emits output[0]
    while done < len(output):
        drafts = propose(prompt + output[:done], k)[:k]
        j = 0
        while j < len(drafts) and done + j < len(output) - 1 and drafts[j] == output[done + j]:
            j += 1
        if drafts or not drafted_only:
            accepted.append(j)
        done += j + 1
    return accepted
