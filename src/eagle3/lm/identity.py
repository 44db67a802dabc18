"""What a verifier is, apart from the bytes one machine made of it: its identity, and its build.

    identity.json        # name, source, import recipe, architecture, tokenizer: the same on every machine
    chat_identity.json   # the tokenizer + chat template fingerprint alone: all that the prompts depend on
    meta.json: build     # this machine's bytes: their hash, torch/transformers, per-tensor statistics

The same GGUF dequantised by another torch (or on another CPU) rounds some bf16 weights the other
way: another build of the same verifier. Artifacts record both; later stages refuse another
identity and accept another build with one log line (``note_other_build``). A drafter also
carries its build's per-tensor statistics, so that ``build_difference`` can compare two builds'
weights where only one folder exists: within one rounding step of the stored dtype, or refused.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eagle3.common import stable_hash
from eagle3.lm.spec import attention_shape

log = logging.getLogger(__name__)

IDENTITY_FILE = "identity.json"
CHAT_IDENTITY_FILE = "chat_identity.json"
# Bumped when the verifier stage would import the same source into other weights or configs (not
# when only the rounding of another torch differs: that is a build).
IMPORT_RECIPE = 1
# The config keys that decide the model's shape, as every transformers version writes them
# (transformers_version, dtype and the keys a newer version adds are records of the writer).
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
                     "n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
# A tensor's statistics in meta.json's build: [dtype, elements, sum, sum of |x|, sum of x^2], in fp64.
STAT_CHUNK = 1 << 24  # elements converted to fp64 at a time (an 8B model's embedding is 0.5 G elements)


def architecture(config: dict[str, Any]) -> dict[str, Any]:
    """The shape of a (text) config dict: ``ARCHITECTURE_KEYS``, the attention heads and the rope settings,
    the same whether a transformers version writes rope_theta/rope_scaling or rope_parameters."""
    shape = {key: config.get(key) for key in ARCHITECTURE_KEYS}
    shape["heads"], shape["kv_heads"], shape["head_dim"] = attention_shape(SimpleNamespace(**config))
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope.setdefault("rope_theta", config.get("rope_theta"))
    if "type" in rope:  # the older spelling of rope_type
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    shape["rope"] = rope
    return shape


def identity_record(name: str, source: dict[str, Any], config: dict[str, Any], tokenizer: str) -> dict[str, Any]:
    """identity.json: what the verifier is, and its id (a hash of the rest)."""
    parts = {"name": name, "recipe": IMPORT_RECIPE, "source": source, "architecture": architecture(config),
             "tokenizer": tokenizer}
    return {"id": stable_hash(parts), **parts}


def tensor_stats(folder: Path) -> dict[str, list]:
    """Every safetensors tensor of ``folder``: [dtype, elements, sum, sum |x|, sum x^2], accumulated in fp64."""
    import torch
    from safetensors import safe_open

    stats: dict[str, list] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as part:
            for name in part.keys():
                tensor = part.get_tensor(name)
                flat, sums = tensor.reshape(-1), [0.0, 0.0, 0.0]
                for start in range(0, flat.numel(), STAT_CHUNK):
                    chunk = flat[start:start + STAT_CHUNK].to(torch.float64)
                    sums = [sums[0] + float(chunk.sum()), sums[1] + float(chunk.abs().sum()), sums[2] + float((chunk * chunk).sum())]
                stats[name] = [str(tensor.dtype).removeprefix("torch."), flat.numel(), *sums]
    return stats


def build_difference(recorded: dict[str, list], current: dict[str, list]) -> str | None:
    """Why two builds' per-tensor statistics are not those of the same weights rounded apart; None when they are.

    Rounded apart: every element differs by at most one step of its dtype (``eps`` times its size), so a
    tensor's sum and sum of |x| move by at most eps * sum |x|, its sum of squares by (2 eps + eps^2) * sum x^2.
    """
    import torch

    if recorded.keys() != current.keys():
        names = sorted(recorded.keys() ^ current.keys())
        return f"tensors {names[:3]}{' ...' if len(names) > 3 else ''} are in one build only"
    for name in sorted(recorded):
        (dtype, count, *old), (other_dtype, other_count, *new) = recorded[name], current[name]
        if (dtype, count) != (other_dtype, other_count):
            return f"tensor {name} is {count} {dtype} values there, {other_count} {other_dtype} here"
        kind = getattr(torch, dtype, None)
        if not (isinstance(kind, torch.dtype) and kind.is_floating_point):
            if old != new:
                return f"tensor {name} ({dtype}) differs"
            continue
        info = torch.finfo(kind)
        slack = info.tiny * count  # values at the bottom of the range round by absolute, not relative, steps
        abs_bound = info.eps * max(old[1], new[1]) + slack
        square_bound = (2 * info.eps + info.eps ** 2) * max(old[2], new[2]) + slack
        for what, delta, bound in (("sum", new[0] - old[0], abs_bound), ("sum of |x|", new[1] - old[1], abs_bound),
                                   ("sum of squares", new[2] - old[2], square_bound)):
            if abs(delta) > bound:
                return f"tensor {name}'s {what} moved by {abs(delta):.3g}, more than one {dtype} rounding step allows ({bound:.3g})"
    return None


def build_label(build: dict[str, Any]) -> str:
    """``build``'s id and the versions that made it, e.g. 'b1d2... (torch 2.11.0, transformers 5.17.0)'."""
    return f"{build.get('id')} (torch {build.get('torch')}, transformers {build.get('transformers')})"


def note_other_build(where: str, made: str, recorded: Any, current: dict[str, Any], compared: str = "") -> None:
    """Log, in one line, that ``where`` was made with another build (``recorded``: its id or build record) of this verifier."""
    recorded_label = build_label(recorded) if isinstance(recorded, dict) else str(recorded)
    recorded_id = recorded.get("id") if isinstance(recorded, dict) else recorded
    if recorded_id is not None and recorded_id != current.get("id"):
        log.warning("%s: %s build %s of this verifier, this machine's build is %s%s; accepted (same identity)",
                    where, made, recorded_label, build_label(current), compared)
