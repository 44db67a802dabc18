"""What varies by verifier, stated once: the ``model`` params section, checked against the verifier.

    spec = VerifierSpec.from_params(params.model)          # the model keys this stage declares
    spec = spec.against(text_config("models/verifier"))    # and its taps against the verifier's layers
    fmt = spec.chat.for_tokenizer(tokenizer)               # how conversations render (eagle3.lm.chat)
    aux = tapped_features(out.hidden_states, spec.aux_layers)     # [B, T, 3H]
    require_verifier("data/merged/meta.json", "built for", recorded, fingerprint)

Why: every stage depends on the same few facts about the verifier (which layers are tapped, which
hidden state is final, how a conversation becomes tokens, where the text model sits in the
checkpoint, the drafter's shape), and on refusing artifacts another verifier produced. Each rule
lives here once; a new verifier family is a conf/model file, plus a change here only if it breaks
one of these rules. What the taps and the final state mean: docs/design.md §1.

A stage reads only the keys it declares (``settings.stage_params``), so a spec holds the declared
keys and nothing else: extract's has the taps and the chat format but not the draft head (a
draft_head change must not re-extract), and reading a key the stage did not declare raises, as the
params view itself does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from omegaconf import DictConfig

from eagle3.common import UserError, to_plain
from eagle3.lm.chat import ChatFormat
from eagle3.schema import ABSENT, BOOL, PLACEMENT, POSITIVE, Lookup, integer, refuse, setting

NUM_TAPS = 3  # low, middle and high layer: fc reads 3H
FINAL_STATES = ("post-norm",)  # train applies only the lm_head to `final`: it must be after the final norm
# The verifier tensors training reads (its frozen embedding, lm_head and final norm), by their HF
# names in the checkpoint's safetensors; a tied lm_head is absent and falls back to the embedding.
VERIFIER_TENSORS = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "norm": "model.norm.weight"}


def tap_problem(ids: Sequence[int], num_layers: int) -> str | None:
    """Why ``ids`` cannot be the taps of a verifier with ``num_layers`` layers (0: unknown); None if they can.

    Layer 0 is refused: SGLang's config names the taps as k - 1 (see ``drafter.export``).
    Example: tap_problem([2, 15, 27], 30) is None; tap_problem([0, 15, 27], 30) names [1, 30).
    """
    ids = [int(i) for i in ids]
    span = f"in [1, {num_layers})" if num_layers else ">= 1 (and below the verifier's layer count)"
    if len(ids) != NUM_TAPS or ids != sorted(set(ids)) or ids[0] < 1 or (num_layers and ids[-1] >= num_layers):
        return f"aux_layers {ids} must be {NUM_TAPS} ascending layer ids {span}"
    return None


def verifier_mismatch(where: str, made: str, recorded: Any, fingerprint: str, current: str = "models/verifier is") -> str | None:
    """The one-line problem of an artifact another verifier produced; None when the fingerprints agree.

    Example: verifier_mismatch("data/merged/meta.json", "built for", "ab12", "cd34") ==
    "data/merged/meta.json: built for verifier ab12, models/verifier is cd34".
    """
    if recorded == fingerprint:
        return None
    return f"{where}: {made} verifier {recorded}, {current} {fingerprint}"


def require_verifier(where: str, made: str, recorded: Any, fingerprint: str, current: str = "models/verifier is",
                     fix: str = "re-run `dvc repro`") -> None:
    """Raise ``verifier_mismatch`` and what to do as one UserError line when there is a mismatch."""
    problem = verifier_mismatch(where, made, recorded, fingerprint, current)
    if problem:
        raise UserError(f"{problem}; {fix}")


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) of a verifier's (text) config: kv heads default to the query heads
    (no grouped-query attention), head_dim to hidden_size / heads."""
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def tapped_features(hidden_states: Sequence, aux_layers: Sequence[int]):
    """The drafter's input features: the tapped residual streams concatenated, [B, T, H] x 3 -> [B, T, 3H].

    ``hidden_states`` is HF ``output_hidden_states`` (index k: the stream entering layer k).
    """
    import torch  # here, so that reading params (eagle3 params, config.validate) does not load torch

    return torch.cat([hidden_states[k] for k in aux_layers], -1)


@dataclass(frozen=True)
class LanguageModel:
    """Where the language model sits in the verifier's checkpoint (params ``model.language_model``).

    A plain causal LM has the defaults: ``config.json`` is its config, its weights are ``model.*``
    and ``lm_head.*``. Kimi-K2.5 nests it: ``config: text_config``, ``prefix: language_model.``,
    and ``model_type: deepseek_v3`` because its text config names a remote-code type (``kimi_k2``)
    that transformers' own DeepSeek-V3 class reads (and can shard: it has TP and EP plans).
    """

    config: str | None = None  # key of its sub-config in config.json; None: config.json itself
    prefix: str = ""  # prefix of its weight names (its embedding is <prefix>model.embed_tokens.weight)
    model_type: str | None = None  # transformers model type that builds it; None: its config's own

    @classmethod
    def from_params(cls, section: DictConfig | dict | None) -> LanguageModel:
        section = to_plain(section) or {}
        unknown = sorted(set(section) - {"config", "prefix", "model_type"})
        if unknown:
            raise UserError(f"params.yaml: model.language_model has unknown keys {unknown}; known: config, prefix, model_type")
        return cls(section.get("config"), section.get("prefix") or "", section.get("model_type"))

    @property
    def nested(self) -> bool:
        return self.config is not None or bool(self.prefix) or self.model_type is not None

    def key_mapping(self) -> dict[str, str] | None:
        """transformers' ``key_mapping`` that strips the prefix from checkpoint names (None: nothing to strip)."""
        return {f"^{re.escape(self.prefix)}": ""} if self.prefix else None


def optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


@dataclass(frozen=True)
class VerifierSpec:
    """The ``model`` keys one stage declares, each read once as ``ModelSettings`` declares it (``spec.aux_layers``: a
    tuple). Reading a key its stage does not declare raises, as the params view itself does."""

    values: dict[str, Any]  # the declared keys, read

    @staticmethod
    def keys() -> dict[str, Callable[[Any], Any]]:
        """Every model key a spec may hold, with how it is read: ``ModelSettings``' fields, and the conf/model file's name."""
        return {"name": str, **{item.name: item.metadata["read"] or (lambda value: value) for item in fields(ModelSettings)}}

    def __getattr__(self, key: str) -> Any:
        values = self.__dict__.get("values", {})
        if key in values:
            return values[key]
        if key in self.keys():
            raise KeyError(f"model.{key}: not among this stage's declared params (its PARAMS and dvc.yaml params:)")
        raise AttributeError(key)

    @classmethod
    def from_params(cls, model: DictConfig, hf_config=None) -> VerifierSpec:
        """The spec of a stage's ``params.model`` view; with the verifier's HF config, checked against it."""
        values = {key: read(model[key]) for key, read in cls.keys().items() if key in model}
        if "final_state" in values and values["final_state"] not in FINAL_STATES:
            raise UserError(f"params.yaml: model.final_state must be one of {list(FINAL_STATES)} (train applies only the lm_head to `final`)")
        spec = cls(values)
        return spec if hf_config is None else spec.against(hf_config)

    def against(self, hf_config, where: str = "models/verifier") -> VerifierSpec:
        """This spec with the verifier's own layer count (nested configs: the language model's), its taps checked."""
        spec = VerifierSpec({**self.values, "num_layers": int(hf_config.get_text_config().num_hidden_layers)})
        spec.check_taps(f" (the layers of {where})")
        return spec

    def check_taps(self, where: str = "") -> None:
        """Refuse taps outside the layers, when this spec holds both (the layer count: model.num_layers,
        or the verifier's own after ``against``; without one, any 3 ascending ids pass)."""
        if "aux_layers" in self.values:
            problem = tap_problem(self.aux_layers, self.values.get("num_layers", 0))
            if problem:
                raise UserError(f"params.yaml: model.{problem}{where}")

    @property
    def chat(self) -> ChatFormat:
        """How conversations render (model.chat_template, reasoning_format, end_of_turn)."""
        return ChatFormat(self.chat_template, self.reasoning_format, self.end_of_turn)


@dataclass(frozen=True)
class ModelSettings:
    """The ``model`` params section's schema: one field per key of conf/model/*.yaml and conf/config.yaml's
    ``model`` defaults, with the key's check; ``VerifierSpec`` reads them, its rules in ``relations``."""

    GROUP: ClassVar[str] = "model"

    source: dict = setting()  # where the weights come from, by kind (verifier_sources)
    copy_weights: bool = setting(BOOL)  # store the weights in models/verifier (DVC-cached)
    trust_remote_code: bool = setting(BOOL, read=bool)  # the verifier's tokenizer/model need their own code
    num_layers: int = setting(POSITIVE, read=int)  # decoder layers (the verifier's own once checked against its config)
    max_position_embeddings: int = setting(POSITIVE, read=int)  # the verifier's context: prompt + answer limit of generate
    aux_layers: tuple[int, ...] = setting(read=lambda v: tuple(int(i) for i in v))  # taps: residual stream entering layer k, 3 ascending ids
    language_model: LanguageModel = setting(read=LanguageModel.from_params)  # where the text model sits in the checkpoint
    placement: dict = setting(PLACEMENT)  # GPUs one copy needs (layout.verifier of the GPU layouts)
    final_state: str = setting(read=str)  # which hidden state `final` is: post-norm (FINAL_STATES)
    chat_template: str | None = setting(read=optional_str)  # Jinja written into models/verifier; null: the tokenizer's own
    reasoning_parser: str | None = setting(read=optional_str)  # SGLang --reasoning-parser; null: the model does not reason
    reasoning_format: str = setting(read=str)  # "template", or a prefix with {reasoning} put before the answer
    end_of_turn: str | None = setting(read=optional_str)  # the marker closing an answer (in the loss mask); null: the eos token
    stop: tuple[str, ...] = setting(read=lambda v: tuple(str(s) for s in v))  # strings ending an answer besides EOS
    draft_head: dict = setting(read=lambda v: dict(to_plain(v) or {}))  # overrides of the drafter's shape (default: the verifier's)

    @staticmethod
    def relations(get: Lookup) -> None:
        """The taps a list of layer ids; the spec's rules (the taps within model.num_layers when the view has
        it, the final state; extract checks the taps against the verifier's own layers)."""
        layers, model = get("model.aux_layers"), get("model")
        if layers is not ABSENT and (not isinstance(layers, list) or not all(integer(0)(k) for k in layers)):
            raise refuse("model.aux_layers", layers, "a list of layer ids")
        if model is not ABSENT:
            VerifierSpec.from_params(model).check_taps()
