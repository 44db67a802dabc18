"""What ``evaluate`` reads from params: its section and the layout (hardware only).

    settings = Settings.from_params(stage_params(evaluate.PARAMS, "params.yaml"))
    settings.methods()   # {"plain": None, "chain": TreeShape.chain(K), "tree": ...}

Why a module of its own: the timed decoding (``eagle3.decoding.timing``) is planned by these
settings as much as the stage is.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from eagle3.decoding.tree import TreeShape
from eagle3.lm.loading import Placement
from eagle3.lm.spec import VerifierSpec


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What ``evaluate`` reads from params: its section and the layout (hardware only)."""

    draft_tokens: int  # K: chain drafts per verifier forward
    tree: TreeShape | None  # SGLang's draft tree (num_steps, topk, num_draft_tokens); None: chain only
    batch_sizes: tuple[int, ...]  # prompts decoded together, one timing per size; τ and outputs at the largest
    repeats: int  # timings per batch size (median and spread); one: no spread, so no speedup metric
    timed_prompts: int | None  # timings at batch size B on a set's first max(this, B) prompts; None: all
    timed_new_tokens: int | None  # tokens per prompt in the timings (at most max_new_tokens); None: max_new_tokens
    chain_sweep: tuple[int, ...]  # chain K also timed, on every set at the first batch size (the best K)
    cuda_graphs: bool  # on a GPU, static caches and captured steps (``eagle3.decoding.graphed``); False: eager
    max_new_tokens: int  # tokens generated per prompt in the τ decode (fewer at EOS)
    position_buckets: tuple[int, ...]  # edges of the answer-position buckets of τ, e.g. (64, 256): 0-64, 64-256, 256+
    sets: tuple[str, ...]  # eval sets: data/prompts/eval/<set>.jsonl
    max_prompts: int | None  # at most this many prompts per set (file order); None: all
    baseline: bool  # also replay the most-frequent-token and n-gram baselines
    device: str
    dtype: str
    threads: int
    stop: tuple[str, ...]  # model.stop: strings ending an answer besides EOS (decoding stops there, as generation did)
    trust_remote_code: bool
    placement: Placement  # layout.verifier: tp > 1 decodes with one copy sharded over tp torchrun processes

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        cfg, layout, spec = params.evaluate, params.layout, VerifierSpec.from_params(params.model)
        tree = cfg.tree
        return cls(  # values validated by config.validate (stage_params), the tree's shape included
            draft_tokens=int(cfg.draft_tokens),
            tree=None if tree is None else TreeShape(int(tree.num_steps), int(tree.topk), int(tree.num_draft_tokens)),
            batch_sizes=tuple(map(int, cfg.batch_sizes)), repeats=int(cfg.repeats),
            timed_prompts=None if cfg.timed_prompts is None else int(cfg.timed_prompts),
            timed_new_tokens=None if cfg.timed_new_tokens is None else int(cfg.timed_new_tokens),
            chain_sweep=tuple(map(int, cfg.chain_sweep)), cuda_graphs=bool(cfg.cuda_graphs),
            max_new_tokens=int(cfg.max_new_tokens), position_buckets=tuple(map(int, cfg.position_buckets)), sets=tuple(cfg.sets),
            max_prompts=None if cfg.max_prompts is None else int(cfg.max_prompts), baseline=bool(cfg.baseline),
            device=str(layout.device), dtype=str(layout.dtype), threads=int(layout.threads), stop=spec.stop,
            trust_remote_code=spec.trust_remote_code, placement=Placement.from_params(layout),
        )

    @property
    def timed_tokens(self) -> int:
        """Tokens per prompt in the timings: ``timed_new_tokens``, at most ``max_new_tokens``."""
        return min(self.timed_new_tokens or self.max_new_tokens, self.max_new_tokens)

    def methods(self) -> dict[str, TreeShape | None]:
        """Decoding methods: plain greedy (None), the chain, and the tree when configured."""
        return {"plain": None, "chain": TreeShape.chain(self.draft_tokens), **({"tree": self.tree} if self.tree else {})}

    def drafting_methods(self) -> dict[str, TreeShape]:
        """The methods that draft (τ is theirs): the chain, and the tree when configured."""
        return {name: shape for name, shape in self.methods().items() if shape}

    def chain_methods(self) -> dict[str, TreeShape | None]:
        """Plain greedy and a chain per K of ``chain_sweep``: {"plain": None, "k2": chain(2), ...}."""
        return {"plain": None, **{f"k{k}": TreeShape.chain(k) for k in self.chain_sweep}}
