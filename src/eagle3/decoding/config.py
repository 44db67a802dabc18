"""The ``evaluate`` params section as decoding reads it: its schema, and the draft tree's shape.

    cfg = EvaluateConfig.from_params(params.evaluate)   # every key of conf/evaluate/*.yaml, typed
    cfg.tree                                            # TreeShape(num_steps=5, topk=4, num_draft_tokens=16), or None

Why apart from ``settings``: ``eagle3.config`` validates every stage's view with this schema, and
imports nothing heavier than it (no torch); ``settings.Settings`` adds the layout evaluate runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.common import UserError
from eagle3.schema import ABSENT, BOOL, NON_NEGATIVE, POSITIVE, SOME_OR_ALL, Check, Lookup, integer, or_null, read_section, refuse, setting

TREE_KEYS = ("num_steps", "topk", "num_draft_tokens")


@dataclass(frozen=True)
class TreeShape:
    """SGLang's draft-tree flags: --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens."""

    num_steps: int  # drafter steps = the deepest draft
    topk: int  # children kept per expanded node, and nodes expanded per step
    num_draft_tokens: int  # tokens per verifier forward: the root plus num_draft_tokens - 1 drafts

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(num_steps=k, topk=1, num_draft_tokens=k + 1)


def tree_shape_problem(num_steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """Why SGLang's tree expansion cannot fill this draft tree, or None when it can."""
    most = topk + (num_steps - 1) * topk**2  # nodes the expansion produces
    if min(num_steps, topk) < 1:
        return f"num_steps and topk must be >= 1, got {num_steps} and {topk}"
    if not 2 <= num_draft_tokens <= most + 1:
        return (f"num_draft_tokens must be in 2..{most + 1} (1 + the {most} nodes of {num_steps} steps of "
                f"top-{topk}), got {num_draft_tokens}")
    return None


def _integers(v) -> bool:
    return isinstance(v, list) and all(integer(1)(x) for x in v)


def _set_size(entry) -> int | None:
    """The prompt count of a ``dataset.eval_sets`` entry (``n`` or ``{prompts: n, ...}``; DatasetSettings checks it)."""
    return entry.get("prompts") if isinstance(entry, dict) else entry


def _tree(value: dict | None) -> TreeShape | None:
    return None if value is None else TreeShape(**{key: value[key] for key in TREE_KEYS})


TREE = Check(or_null(lambda v: isinstance(v, dict) and set(v) == set(TREE_KEYS) and all(integer(0)(v[key]) for key in TREE_KEYS)),
             "null, or integers num_steps, topk and num_draft_tokens")
SIZES = Check(lambda v: _integers(v) and bool(v), "a non-empty list of integers >= 1")
CHAINS = Check(_integers, "a list of integers >= 1 (chain K)")
EDGES = Check(lambda v: _integers(v) and v == sorted(set(v)), "a list of increasing integers >= 1 (answer positions)")
NAMES = Check(lambda v: isinstance(v, list) and bool(v), "a non-empty list of eval set names")
TOKENS_OR_ALL = Check(or_null(integer(1)), "an integer >= 1, or null for max_new_tokens")


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """The ``evaluate`` params section and its schema: one field per key of conf/evaluate/*.yaml, with its
    check (``eagle3.schema``), and the rules over several keys in ``relations``. No field has a
    default: the values come from params.yaml alone."""

    GROUP: ClassVar[str] = "evaluate"

    draft_tokens: int = setting(POSITIVE)  # K: chain drafts per verifier forward
    tree: TreeShape | None = setting(TREE, read=_tree)  # SGLang's draft tree (num_steps, topk, num_draft_tokens); None: chain only
    batch_sizes: tuple[int, ...] = setting(SIZES, read=tuple)  # prompts decoded together, one timing per size; τ and outputs at the largest
    repeats: int = setting(NON_NEGATIVE)  # timings per batch size (median, spread); 1: no spread, no speedup metric; 0: τ alone
    timed_prompts: int | None = setting(SOME_OR_ALL)  # timings at batch size B on a set's first max(this, B) prompts; None: all
    timed_new_tokens: int | None = setting(TOKENS_OR_ALL)  # tokens per prompt in the timings (at most max_new_tokens); None: max_new_tokens
    cuda_graphs: bool = setting(BOOL)  # on a GPU, static caches and captured steps (``eagle3.decoding.graphed``); False: eager
    chain_sweep: tuple[int, ...] = setting(CHAINS, read=tuple)  # chain K also timed, on every set at the first batch size (the best K)
    max_new_tokens: int = setting(POSITIVE)  # tokens generated per prompt in the τ decode (fewer at EOS)
    position_buckets: tuple[int, ...] = setting(EDGES, read=tuple)  # edges of τ's answer-position buckets, e.g. (64, 256): 0-64, 64-256, 256+
    sets: tuple[str, ...] = setting(NAMES, read=tuple)  # eval sets: data/prompts/eval/<set>.jsonl
    max_prompts: int | None = setting(SOME_OR_ALL)  # at most this many prompts per set (file order); None: all
    baseline: bool = setting(BOOL)  # also replay the most-frequent-token and n-gram baselines

    @staticmethod
    def relations(get: Lookup) -> None:
        """The tree a shape SGLang's expansion can fill (refused here, not after training); the sets some
        of those dataset.eval_sets builds; a chain sweep only where there are timings."""
        tree = get("evaluate.tree")
        if tree not in (ABSENT, None):
            problem = tree_shape_problem(*(tree[key] for key in TREE_KEYS))
            if problem:
                raise UserError(f"params.yaml: evaluate.tree: {problem}")
        built, chosen = get("dataset.eval_sets"), get("evaluate.sets")
        if ABSENT not in (built, chosen) and set(chosen) - set(built):
            raise refuse("evaluate.sets", chosen, f"sets that dataset.eval_sets builds ({sorted(built)})")
        empty = [name for name in chosen if _set_size(built[name]) == 0] if ABSENT not in (built, chosen) else []
        if empty:
            raise refuse("evaluate.sets", chosen, f"sets with prompts: dataset.eval_sets gives {empty} none; give them "
                         "prompts, or list the others in evaluate.sets")
        if get("evaluate.repeats") == 0 and get("evaluate.chain_sweep") not in (ABSENT, []):
            raise refuse("evaluate.chain_sweep", get("evaluate.chain_sweep"), "[] with evaluate.repeats 0 (nothing timed), "
                         "or set evaluate.repeats >= 1 to time the chains")

    @classmethod
    def from_params(cls, section) -> EvaluateConfig:
        """The section's values as decoding uses them (lists as tuples, the tree as a ``TreeShape``); validated by the
        schema (stage_params), the tree's shape included."""
        return read_section(cls, section)
