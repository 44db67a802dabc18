"""The ``merge`` params section's schema: how the merge stage filters and splits the extracted
samples into the training mixture, and sizes the draft vocabulary.

    check_schema(MixtureSettings, get)    # config.validate, for every view holding merge keys

Apart from the stage module: ``eagle3.config`` validates every view with it, and a library module
never imports a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.prompt_sources.names import configured_sources, source_name
from eagle3.schema import ABSENT, FRACTION_BELOW_1, POSITIVE, SOME_OR_ALL, Check, Lookup, number, refuse, setting

SOURCE_REPEATS = Check(lambda v: isinstance(v, dict) and all(isinstance(k, str) and number(0)(x) for k, x in v.items()),
                       "a mapping of source names to numbers >= 0 ({copy: 2}), {} for none")


@dataclass(frozen=True)
class MixtureSettings:
    """One field per key of conf/merge/*.yaml (read by the merge stage)."""

    GROUP: ClassVar[str] = "merge"

    val_fraction: float = setting(FRACTION_BELOW_1)  # share of samples held out for validation
    train_prompts: int | None = setting(SOME_OR_ALL)  # train on the first N prompts of the train split; None: all
    min_tokens: int = setting(POSITIVE)  # drop samples with fewer loss-masked tokens
    max_tokens: int = setting(POSITIVE)  # drop samples longer than this (relations: >= min_tokens)
    draft_vocab_size: int = setting(POSITIVE)  # Vd, capped at the verifier's vocabulary
    # The validation split stays as it is; a source not named: once.
    source_repeats: dict = setting(SOURCE_REPEATS)  # times a source's training samples appear, by name (2: twice, 0.5: a seeded half)

    @staticmethod
    def relations(get: Lookup) -> None:
        """A sample can be kept: the length bounds do not cross; a repeated source is one of the dataset's."""
        low, high = get("merge.min_tokens"), get("merge.max_tokens")
        if ABSENT not in (low, high) and high < low:
            raise refuse("merge.max_tokens", high, f">= merge.min_tokens ({low})")
        repeats, sources, extra = get("merge.source_repeats"), get("dataset.sources"), get("dataset.extra_sources")
        if ABSENT in (repeats, sources) or not isinstance(repeats, dict):
            return
        dataset = {"sources": sources, "extra_sources": None if extra is ABSENT else extra}
        names = [source_name(spec) for _, spec in configured_sources(dataset) if isinstance(spec, dict)]
        unknown = sorted(set(repeats) - set(names))
        if unknown:
            raise refuse("merge.source_repeats", repeats, f"keyed by the names of dataset.sources ({', '.join(names)}): "
                         f"{', '.join(unknown)} is none of them")
