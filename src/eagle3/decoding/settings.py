"""What ``evaluate`` reads from params: its section (``config.EvaluateConfig``, the group's schema)
and the layout (hardware only).

    settings = Settings.from_params(stage_params(PARAMS, "params.yaml"))   # PARAMS: the keys (= evaluate's in dvc.yaml)
    settings.methods()   # {"plain": None, "chain": TreeShape.chain(K), "tree": ...}

Why a module of its own: the timed decoding (``eagle3.decoding.timing``) is planned by these
settings as much as the stage is.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from eagle3.decoding.config import EvaluateConfig, TreeShape
from eagle3.layout import LayoutSettings
from eagle3.lm.loading import Placement
from eagle3.lm.spec import ModelSettings, VerifierSpec
from eagle3.settings import StageParams, keys_of, section

PARAMS = StageParams(section(EvaluateConfig), keys_of(LayoutSettings, "device", "dtype", "threads", "verifier"),
                     keys_of(ModelSettings, "stop", "trust_remote_code"))


@dataclass(frozen=True, kw_only=True)
class Settings(EvaluateConfig):
    """What ``evaluate`` reads from params: its section (the fields of ``EvaluateConfig``) and the
    layout (hardware only)."""

    device: str  # layout.device
    dtype: str  # layout.dtype
    threads: int  # layout.threads
    stop: tuple[str, ...]  # model.stop (decoding stops there, as generation did)
    trust_remote_code: bool  # model.trust_remote_code
    placement: Placement  # layout.verifier: tp > 1 decodes with one copy sharded over tp torchrun processes

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        layout, spec = params.layout, VerifierSpec.from_params(params.model)
        return cls(**vars(EvaluateConfig.from_params(params.evaluate)), device=str(layout.device), dtype=str(layout.dtype),
                   threads=int(layout.threads), stop=spec.stop, trust_remote_code=spec.trust_remote_code,
                   placement=Placement.from_params(layout))

    @property
    def timed_tokens(self) -> int:
        """Tokens per prompt in the timings: ``timed_new_tokens``, at most ``max_new_tokens``."""
        return min(self.timed_new_tokens or self.max_new_tokens, self.max_new_tokens)

    @property
    def timed_sizes(self) -> tuple[int, ...]:
        """The batch sizes timed: all of ``batch_sizes``, none with ``repeats`` 0 (τ alone)."""
        return self.batch_sizes if self.repeats else ()

    def methods(self) -> dict[str, TreeShape | None]:
        """Decoding methods: plain greedy (None), the chain, and the tree when configured."""
        return {"plain": None, "chain": TreeShape.chain(self.draft_tokens), **({"tree": self.tree} if self.tree else {})}

    def drafting_methods(self) -> dict[str, TreeShape]:
        """The methods that draft (τ is theirs): the chain, and the tree when configured."""
        return {name: shape for name, shape in self.methods().items() if shape}

    def chain_methods(self) -> dict[str, TreeShape | None]:
        """Plain greedy and a chain per K of ``chain_sweep``: {"plain": None, "k2": chain(2), ...}."""
        return {"plain": None, **{f"k{k}": TreeShape.chain(k) for k in self.chain_sweep}}
