"""What varies by verifier, stated once: the ``model`` params section, checked against the verifier.

    spec = VerifierSpec.from_params(params.model)                 # conf/model only (eagle3 params)
    spec = VerifierSpec.from_params(params.model, hf_config)      # and against the verifier's config
    aux = tapped_features(out.hidden_states, spec.aux_layers)     # [B, T, 3H]
    require_verifier("data/merged/meta.json", "built for", recorded, fingerprint)

Why: every stage depends on the same few facts about the verifier (which layers are tapped, which
hidden state is final, how a conversation becomes tokens, the drafter's shape), and on refusing
artifacts another verifier produced. Each rule lives here once; a new verifier family is a
conf/model file, plus a line here only if it breaks one of these rules. What the taps and the
final state mean: docs/design.md §1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, to_plain

NUM_TAPS = 3  # low, middle and high layer: fc reads 3H
FINAL_STATES = ("post-norm",)  # train applies only the lm_head to `final`: it must be after the final norm
# The verifier tensors training reads (its frozen embedding, lm_head and final norm), by their HF
# names in the checkpoint's safetensors; a tied lm_head is absent and falls back to the embedding.
VERIFIER_TENSORS = {"embed": "model.embed_tokens.weight", "head": "lm_head.weight", "norm": "model.norm.weight"}


def tap_problem(ids: Sequence[int], num_layers: int) -> str | None:
    """Why ``ids`` cannot be the taps of a verifier with ``num_layers`` layers (0: unknown); None if they can.

    Example: tap_problem([2, 15, 27], 30) is None; tap_problem([2, 15, 30], 30) names [0, 30).
    """
    ids = [int(i) for i in ids]
    bound = num_layers if num_layers else "L"
    if len(ids) != NUM_TAPS or ids != sorted(set(ids)) or ids[0] < 0 or (num_layers and ids[-1] >= num_layers):
        return f"aux_layers {ids} must be {NUM_TAPS} ascending layer ids in [0, {bound})"
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


def tapped_features(hidden_states: Sequence, aux_layers: Sequence[int]):
    """The drafter's input features: the tapped residual streams concatenated, [B, T, H] x 3 -> [B, T, 3H].

    ``hidden_states`` is HF ``output_hidden_states`` (index k: the stream entering layer k).
    """
    import torch  # here, so that reading params (eagle3 params, config.validate) does not load torch

    return torch.cat([hidden_states[k] for k in aux_layers], -1)


@dataclass(frozen=True)
class VerifierSpec:
    """The ``model`` params section as the stages use it (conf/model/*.yaml documents every key)."""

    name: str  # model.name: the conf/model file
    num_layers: int  # decoder layers (the verifier's own count once its config is read)
    aux_layers: tuple[int, ...]  # taps: residual stream entering layer k, 3 ascending ids
    final_state: str  # which hidden state `final` is: post-norm
    chat_template: str | None  # Jinja written into models/verifier; None: the tokenizer's own
    reasoning_format: str  # "template", or a prefix with {reasoning} put before the answer
    end_of_turn: str | None  # the marker closing an answer (in the loss mask); None: the eos token
    stop: tuple[str, ...]  # strings ending an answer besides EOS
    draft_head: dict[str, Any]  # overrides of the drafter's shape (default: the verifier's)
    trust_remote_code: bool  # the verifier's tokenizer/model need their own code

    @classmethod
    def from_params(cls, model: DictConfig, hf_config=None) -> VerifierSpec:
        """The spec of ``params.model``; with the verifier's HF config, the taps are checked against its layers.

        Nested (multimodal) configs are read through ``get_text_config()``: the language model's.
        """
        num_layers = int(model.num_layers)
        if hf_config is not None:
            num_layers = int(hf_config.get_text_config().num_hidden_layers)
        problem = tap_problem(model.aux_layers, num_layers)
        if problem:
            raise UserError(f"params.yaml: model.{problem}" + (" (the layers of models/verifier)" if hf_config is not None else ""))
        if model.final_state not in FINAL_STATES:
            raise UserError(f"params.yaml: model.final_state must be one of {list(FINAL_STATES)} (train applies only the lm_head to `final`)")
        return cls(
            str(model.name), num_layers, tuple(int(i) for i in model.aux_layers), str(model.final_state), model.chat_template,
            str(model.reasoning_format), model.end_of_turn, tuple(model.stop), dict(to_plain(model.draft_head) or {}),
            bool(model.trust_remote_code),
        )
