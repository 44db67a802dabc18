"""What every decode of one evaluation shares: the verifier and where its answers end (a
``speculative.Target``: EOS ids, stop strings, the graphs), the drafter, and the settings.

    session = Session.create(verifier, drafter, settings, eos_ids={2}, stops=stops)
    session.with_graphs(decode_graphs(settings, longest_prompt))   # the same, decoding in CUDA graphs

Why one object: the timed decoding (``eagle3.decoding.timing``) and each set's evaluation
(``eagle3.decoding.evaluation``) pass the same models, ends and graphs through every call.
``for_decoding`` sets the models up for it (``eagle3.lm.loading.prepare_torch``, the process).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from eagle3.decoding.graphed import DecodeGraphs
from eagle3.decoding.settings import Settings
from eagle3.decoding.skinny import skinny_matmuls
from eagle3.decoding.speculative import StopStrings, Target


@dataclass(frozen=True)
class Session:
    """The models and settings of one evaluation; ``target`` taps the drafter's aux layers."""

    target: Target
    drafter: nn.Module
    settings: Settings

    @classmethod
    def create(cls, verifier, drafter: nn.Module, settings: Settings, eos_ids: set[int],
               stops: StopStrings | None = None) -> Session:
        """Eager decoding (no graphs) of ``verifier`` with ``drafter``; answers end at ``eos_ids`` and ``stops``."""
        target = Target(verifier=verifier, layer_ids=drafter.config.aux_layers, eos_ids=eos_ids, stops=stops)
        return cls(target=target, drafter=drafter, settings=settings)

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.target.graphs

    def with_graphs(self, graphs: DecodeGraphs | None) -> Session:
        return replace(self, target=replace(self.target, graphs=graphs))

    def without_stops(self) -> Session:
        """The same decoding with answers ending at EOS and the token budget only (the warm-up's)."""
        return replace(self, target=replace(self.target, stops=None))


def for_decoding(verifier, drafter: nn.Module, settings: Settings) -> None:
    """The few-row matmuls of decoding, the fast way round on the CPU (``skinny_matmuls``)."""
    if settings.device == "cpu" and not settings.placement.sharded:
        skinny_matmuls(verifier), skinny_matmuls(drafter)
