"""Stage ``extract``: the verifier's hidden states at the tapped layers, per token, for one shard.

    python -m eagle3.extract models/verifier data/generated/<shard> data/hidden_states/<shard>
    # params.yaml: extract, model (aux_layers, final_state, chat format), layout (device, dtype, workers)

Each generated conversation is rendered with the verifier's chat template into ``input_ids`` and
a ``loss_mask`` over the answer (``eagle3.hidden_states.samples``), run through the verifier's decoder
(no lm_head) in batches of similar lengths (``eagle3.hidden_states.capture``; over several processes:
``eagle3.hidden_states.workers``), checked, and stored in the ``eagle3.hidden_states.storage`` format:

- ``part-<first record>.safetensors``: samples concatenated along the token axis (~``part_bytes``);
- ``index.jsonl``: per stored sample, in record order: id, record, part, offset, length, masked, truncated,
  max_abs (the largest |value| of its aux and final, checked again when training reads it);
- ``rejected.jsonl``: per rejected record: id, record, reason (nothing is dropped silently);
- ``meta.json``: verifier fingerprint, tapped layers and their convention, final-state norm, dtype, counts,
  and the sha256 of every other file of the shard (train refuses a file that no longer matches).

Conventions (also written to meta.json):
- ``aux[:, i*H:(i+1)*H]`` is the residual stream *entering* decoder layer ``aux_layers[i]``, i.e.
  HF ``output_hidden_states[aux_layers[i]]`` (index 0 = embedding output), ascending;
- ``final`` is HF's last hidden state, *after* the final norm: ``lm_head(final)`` = the logits;
- ``loss_mask[t] = 1`` iff token t belongs to the generated answer (reasoning and the end-of-turn
  token included, unless the answer was cut at the token limit; template scaffolding excluded);
  it is not shifted.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.extract")

import argparse
import logging
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eagle3.common import UserError, atomic_dir, read_json, read_jsonl, sha256_file, write_json, write_jsonl
from eagle3.hidden_states.capture import Settings
from eagle3.hidden_states.config import ExtractSettings
from eagle3.hidden_states.samples import Sample, check_rejections, prepare
from eagle3.hidden_states.storage import bytes_per_token, size
from eagle3.hidden_states.workers import Job, run_workers
from eagle3.layout import LayoutSettings
from eagle3.lm.identity import note_other_build
from eagle3.lm.loading import close_sharded, load_tokenizer, read_meta, shard_rank, text_config, verifier_build, verifier_fingerprint
from eagle3.lm.spec import ModelSettings, VerifierSpec, require_verifier
from eagle3.settings import StageParams, keys_of, section, stage_params

log = logging.getLogger(__name__)

# = dvc.yaml. The layout too: device and dtype change the stored states, and so can the batch
# composition that workers, threads and the verifier's sharding change (rounding); a layout change re-extracts.
PARAMS = StageParams(section(ExtractSettings),  # = dvc.yaml
                     keys_of(ModelSettings, "aux_layers", "final_state", "chat_template", "reasoning_format", "end_of_turn",
                             "trust_remote_code"),
                     keys_of(LayoutSettings, "device", "dtype", "extract_workers", "threads", "verifier"))

DISK_FREE_ENV = "EAGLE3_DISK_FREE_BYTES"  # overrides the measured free space (tests, quotas)
INDEX_BYTES_PER_SAMPLE = 256  # index.jsonl line + share of a part header
FIXED_OVERHEAD_BYTES = 1 << 20  # meta.json, rejected.jsonl, slack
LAYER_CONVENTION = "aux layer k = residual stream entering decoder layer k = HF output_hidden_states[k] (0 = embeddings)"


# --- disk preflight ------------------------------------------------------------------------------


def disk_free(path: Path) -> tuple[int, Path]:
    """Free bytes where ``path`` will be written (its nearest existing ancestor), or $EAGLE3_DISK_FREE_BYTES."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    override = os.environ.get(DISK_FREE_ENV)
    return (int(override) if override else shutil.disk_usage(existing).free), existing


def preflight(samples: list[Sample], hidden_size: int, settings: Settings, out: Path) -> int:
    """Refuse to start when the disk cannot hold the output; returns the estimated bytes."""
    tokens = sum(len(s.input_ids) for s in samples)
    need = tokens * bytes_per_token(hidden_size, len(settings.aux_layers), settings.dtype)
    need += len(samples) * INDEX_BYTES_PER_SAMPLE + FIXED_OVERHEAD_BYTES
    free, where = disk_free(out)
    if need > free:
        raise UserError(
            f"extract: needs {size(need)}, {size(free)} free on {where}; free space, "
            "or store less (extract.dtype=float8_e4m3fn halves it, or lower extract.max_length)"
        )
    log.info("preflight: %d tokens -> %s, %s free on %s", tokens, size(need), size(free), where)
    return need


# --- the stage ------------------------------------------------------------------------------------


def check_generated(generated: Path, fingerprint: str, build: dict[str, Any]) -> None:
    """Refuse conversations that another verifier produced (when their meta.json says so); another build
    of this one (another machine's torch) is said in one line."""
    meta_path = generated / "meta.json"
    if not meta_path.is_file():
        return
    meta = read_json(meta_path)
    if meta.get("verifier") is not None:  # generate records the identity's id, and its build's
        require_verifier(str(meta_path), "generated by", meta["verifier"], fingerprint)
        note_other_build(str(meta_path), "generated by", meta.get("verifier_build"), build)


def verifier_shape(verifier: Path, settings: Settings, spec: VerifierSpec) -> dict[str, int]:
    """Hidden size, vocabulary and layer count from the verifier's config (no weights loaded); refuses
    taps outside its layers and a ``layout.verifier`` placement it cannot be sharded with."""
    config = text_config(verifier, spec.trust_remote_code)
    settings.placement.check(config, settings.device)
    spec.against(config, str(verifier))
    return {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "num_layers": config.num_hidden_layers}


def stage_arguments(params: DictConfig) -> tuple[Settings, VerifierSpec]:
    """``extract``'s typed arguments from its params view."""
    return Settings.from_params(params), VerifierSpec.from_params(params.model)


def extract(verifier: Path, generated: Path, out: Path, settings: Settings, spec: VerifierSpec) -> dict[str, Any]:
    """The whole stage for one shard; returns the written meta.json (on the other processes of a
    sharded verifier, which write nothing: {})."""
    trust = spec.trust_remote_code
    fingerprint, build = verifier_fingerprint(verifier), verifier_build(verifier)
    check_generated(generated, fingerprint, build)
    tokenizer = load_tokenizer(verifier, trust)
    fmt = spec.chat.for_tokenizer(tokenizer)
    records = list(read_jsonl(generated / "records.jsonl"))
    samples, rejected = prepare(records, tokenizer, fmt, settings.max_length)
    check_rejections(generated, rejected, len(records))  # before the forward: most rejections are known here
    if not samples:  # no records at all: rejecting most of them was refused above
        raise UserError(f"{generated}/records.jsonl: no records to extract")
    shape = verifier_shape(verifier, settings, spec)
    estimate = preflight(samples, shape["hidden_size"], settings, out)
    if shard_rank() != 0:  # another process of a sharded verifier: the same inputs, checks and forwards; rank 0 writes
        run_workers(Job(verifier, settings, None, trust, tokenizer.pad_token_id or 0), samples)
        return {}
    with atomic_dir(out) as tmp:
        index, late, sha256 = run_workers(Job(verifier, settings, tmp, trust, tokenizer.pad_token_id or 0), samples)
        index.sort(key=lambda entry: entry["record"])
        rejected = sorted(rejected + late, key=lambda entry: entry["record"])
        check_rejections(generated, rejected, len(records))
        if len(index) + len(rejected) != len(records):
            raise RuntimeError(f"accounting: {len(index)} stored + {len(rejected)} rejected != {len(records)} records")
        write_jsonl(tmp / "index.jsonl", index)
        write_jsonl(tmp / "rejected.jsonl", rejected)
        meta = {
            "verifier": {"name": read_meta(verifier)["name"], "fingerprint": fingerprint, "build": build["id"]},
            **shape,
            "aux_layers": list(settings.aux_layers),
            "layer_convention": LAYER_CONVENTION,
            "final_state": spec.final_state,  # HF's last hidden state: the final norm is applied; train applies lm_head only
            "dtype": settings.dtype,
            "fp8_scale": "per token and tapped layer: aux_scale [N, 3], final_scale [N, 1]" if settings.dtype != "bfloat16" else None,
            "max_length": settings.max_length,
            "loss_mask": "1 on the generated answer (reasoning included; end-of-turn included unless cut at the token limit), unshifted",
            "chat": {"chat_template": fmt.chat_template, "reasoning_format": fmt.reasoning_format, "end_of_turn": fmt.end_of_turn},
            "counts": {
                "records": len(records),
                "samples": len(index),
                "rejected": len(rejected),
                "tokens": sum(e["length"] for e in index),
                "masked_tokens": sum(e["masked"] for e in index),
                "truncated": sum(e["truncated"] for e in index),
                "rejected_by_reason": dict(Counter(r["reason"] for r in rejected)),
            },
            "estimated_bytes": estimate,
            "parts": sorted({e["part"] for e in index}),
            "sha256": {**sha256, **{name: sha256_file(tmp / name) for name in ("index.jsonl", "rejected.jsonl")}},
            "params": settings.section(),
        }
        write_json(tmp / "meta.json", meta)
    counts = meta["counts"]
    log.info("%s: %d samples, %d tokens, %d rejected, %d truncated", out, counts["samples"], counts["tokens"], counts["rejected"], counts["truncated"])
    return meta


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.extract", description="capture the verifier's hidden states of one shard")
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("generated", type=Path, help="generated shard, e.g. data/generated/000000-000032")
    parser.add_argument("out", type=Path, help="output folder, e.g. data/hidden_states/000000-000032")
    parser.add_argument("--params", default="params.yaml")
    args = parser.parse_args(argv)
    settings, spec = stage_arguments(stage_params(PARAMS, args.params))
    if settings.placement.sharded:  # refuse a placement the verifier cannot take before tp processes start
        verifier_shape(args.verifier, settings, spec)
    if settings.placement.launch("eagle3.extract", argv):
        return
    extract(args.verifier, args.generated, args.out, settings, spec)
    close_sharded()
