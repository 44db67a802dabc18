"""The ``merge`` params section's schema: how the merge stage filters and splits the extracted
samples into the training mixture, and sizes the draft vocabulary.

    check_schema(MixtureSettings, get)    # config.validate, for every view holding merge keys

Apart from the stage module: ``eagle3.config`` validates every view with it, and a library module
never imports a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.schema import ABSENT, FRACTION_BELOW_1, POSITIVE, SOME_OR_ALL, Lookup, refuse, setting


@dataclass(frozen=True)
class MixtureSettings:
    """One field per key of conf/merge/*.yaml (read by the merge stage)."""

    GROUP: ClassVar[str] = "merge"

    val_fraction: float = setting(FRACTION_BELOW_1)  # share of samples held out for validation
    train_prompts: int | None = setting(SOME_OR_ALL)  # train on the first N prompts of the train split; None: all
    min_tokens: int = setting(POSITIVE)  # drop samples with fewer loss-masked tokens
    max_tokens: int = setting(POSITIVE)  # drop samples longer than this (relations: >= min_tokens)
    draft_vocab_size: int = setting(POSITIVE)  # Vd, capped at the verifier's vocabulary

    @staticmethod
    def relations(get: Lookup) -> None:
        """A sample can be kept: the length bounds do not cross."""
        low, high = get("merge.min_tokens"), get("merge.max_tokens")
        if ABSENT not in (low, high) and high < low:
            raise refuse("merge.max_tokens", high, f">= merge.min_tokens ({low})")
