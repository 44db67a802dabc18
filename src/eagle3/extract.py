"""Stage ``extract``: the verifier's hidden states at the tapped layers, per token, for one shard.

    python -m eagle3.extract models/verifier data/generated/<shard> data/hidden_states/<shard>
    # params.yaml: extract, model (aux_layers, final_state, chat format), layout (device, dtype, workers)

Each generated conversation is rendered with the verifier's chat template into ``input_ids`` and
a ``loss_mask`` over the answer (``eagle3.verifiers.chat.render``), run through the verifier's decoder (no lm_head) in
batches of similar lengths, checked, and stored in the ``eagle3.hidden_states.storage`` format:

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

import argparse
import logging
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import (UserError, atomic_dir, exit_with_launcher, read_json, read_jsonl, sha256_file, stage_main, write_json,
                           write_jsonl)
from eagle3.config import stage_params
from eagle3.hidden_states.storage import PartWriter, encode_sample, magnitudes, size
from eagle3.verifiers.chat import ChatFormat, RenderError, render
from eagle3.verifiers.loading import Placement, close_sharded, load_tokenizer, load_verifier, read_meta, shard_rank, text_config
from eagle3.verifiers.spec import VerifierSpec, require_verifier, tapped_features

log = logging.getLogger(__name__)

# = dvc.yaml. The layout too: device and dtype change the stored states, and so can the batch
# composition that workers, threads and the verifier's sharding change (rounding); a layout change re-extracts.
PARAMS = ("extract", "model.aux_layers", "model.final_state", "model.chat_template", "model.reasoning_format",
          "model.end_of_turn", "model.trust_remote_code", "layout.device", "layout.dtype", "layout.extract_workers",
          "layout.threads", "layout.verifier")

DISK_FREE_ENV = "EAGLE3_DISK_FREE_BYTES"  # overrides the measured free space (tests, quotas)
INDEX_BYTES_PER_SAMPLE = 256  # index.jsonl line + share of a part header
FIXED_OVERHEAD_BYTES = 1 << 20  # meta.json, rejected.jsonl, slack
MAX_REJECTED_SHARE = 0.10  # a shard rejecting more of its records is refused: a broken rule, not a few bad records
LAYER_CONVENTION = "aux layer k = residual stream entering decoder layer k = HF output_hidden_states[k] (0 = embeddings)"


@dataclass(frozen=True)
class Settings:
    """What ``extract`` reads from params: its section, the taps, and the layout."""

    name: str  # extract.name: the conf/extract file
    aux_layers: tuple[int, ...]  # model.aux_layers: HF hidden_states indices, ascending
    dtype: str  # extract.dtype: storage dtype, bfloat16 | float8_e4m3fn
    max_length: int  # extract.max_length: longer conversations are truncated (and counted)
    batch_tokens: int  # extract.batch_tokens: padded tokens per forward
    part_bytes: int  # extract.part_bytes: target size of a safetensors part
    device: str  # layout.device: cpu | cuda (worker r takes cuda:r)
    compute_dtype: str  # layout.dtype: the verifier's dtype for the forward
    workers: int  # layout.extract_workers: processes, one per device
    threads: int  # layout.threads: torch intra-op threads per process
    placement: Placement  # layout.verifier: a whole copy per worker (tp 1), or one copy over tp workers

    @classmethod
    def from_params(cls, params: DictConfig) -> Settings:
        extract, layout = params.extract, params.layout  # values validated by config.validate
        placement = Placement.from_params(layout)
        if placement.sharded and layout.extract_workers != placement.tp:
            raise UserError(f"params.yaml: layout.verifier.tp {placement.tp} shards one copy of the verifier over {placement.tp} "
                            f"processes (GPUs), layout.extract_workers is {layout.extract_workers}: use a layout with "
                            f"{placement.tp} GPUs (gpu8), or set extract_workers to tp")
        return cls(
            str(extract.name), VerifierSpec.from_params(params.model).aux_layers, extract.dtype, int(extract.max_length), int(extract.batch_tokens),
            int(extract.part_bytes), layout.device, layout.dtype, int(layout.extract_workers), int(layout.threads), placement,
        )

    def section(self) -> dict[str, Any]:
        """The ``extract`` params as read (meta.json's ``params``)."""
        return {"name": self.name, "dtype": self.dtype, "max_length": self.max_length, "batch_tokens": self.batch_tokens,
                "part_bytes": self.part_bytes}


@dataclass
class Sample:
    """A rendered conversation: what the verifier reads and which tokens the drafter learns."""

    id: str
    record: int  # 0-based position in records.jsonl
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


# --- records to samples ------------------------------------------------------------------------


def record_problem(record: dict) -> str | None:
    """Why a generated record is not a conversation ending with an answer, or None."""
    messages = record.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return "record: messages must be a list of at least a prompt and an answer"
    answer = messages[-1]
    if not isinstance(answer, dict) or answer.get("role") != "assistant" or not isinstance(answer.get("content"), str):
        return "record: the last message must be an assistant answer with string content"
    return None


def prepare(records: list[dict], tokenizer, fmt: ChatFormat, max_length: int) -> tuple[list[Sample], list[dict]]:
    """Render every record; returns the samples and the rejections (id, record, reason)."""
    samples, rejected = [], []
    for number, record in enumerate(tqdm(records, desc="render", unit="rec")):
        problem = record_problem(record)
        if problem is None:
            try:
                ids, mask = render(tokenizer, record["messages"], fmt, record.get("finish_reason") != "length", record.get("stop"))
            except RenderError as err:
                problem = f"render: {err}"
        if problem is None:
            truncated = len(ids) > max_length
            ids, mask = ids[:max_length], mask[:max_length]
            problem = mask_problem(mask, truncated)
        if problem is None:
            samples.append(Sample(str(record.get("id")), number, ids, mask, truncated))
        else:
            rejected.append({"id": record.get("id"), "record": number, "reason": problem})
    return samples, rejected


def check_rejections(generated: Path, rejected: list[dict], records: int) -> None:
    """Refuse a shard that rejects more than MAX_REJECTED_SHARE of its records, in one line with the
    reason counts: a rule the configuration breaks (e.g. a chat template that does not write the
    stop string) must not silently cost half the data."""
    if len(rejected) > MAX_REJECTED_SHARE * records:
        reasons = dict(Counter(r["reason"] for r in rejected).most_common())
        raise UserError(f"{generated}/records.jsonl: {len(rejected)} of {records} records rejected, more than "
                        f"{MAX_REJECTED_SHARE:.0%} ({reasons}); fix the cause (model.stop, model.end_of_turn and the chat "
                        "template, or extract.max_length) and re-run extract")


def mask_problem(mask: list[int], truncated: bool) -> str | None:
    if not any(mask):
        return "loss_mask is all zero" + (" after truncation to extract.max_length" if truncated else "")
    if all(mask):
        return "loss_mask is all one (no prompt tokens)"
    return None


# --- the verifier forward -------------------------------------------------------------------------


def batches(samples: list[Sample], batch_tokens: int) -> Iterator[list[Sample]]:
    """Samples by ascending length, grouped so that a padded batch holds ≤ batch_tokens (≥ 1 sample)."""
    batch: list[Sample] = []
    for sample in sorted(samples, key=lambda s: (len(s.input_ids), s.record)):
        if batch and len(sample.input_ids) * (len(batch) + 1) > batch_tokens:
            yield batch
            batch = []
        batch.append(sample)
    if batch:
        yield batch


@torch.inference_mode()
def hidden_states(
    model, batch: list[Sample], aux_layers: tuple[int, ...], pad_id: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One decoder forward over a right-padded batch; per sample ``(input_ids [T], aux [T, 3H], final [T, H])``.

    Right padding leaves the real tokens' states unchanged (causal attention never looks right,
    positions start at 0), so each sample's first T rows are its states. The base model is called,
    not the CausalLM: no lm_head over every position. ``aux`` and ``final`` stay on the verifier's
    device (in its dtype), so that encoding and checks run there too.
    """
    lengths = torch.tensor([len(s.input_ids) for s in batch])
    width = int(lengths.max())
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, W]
    for row, sample in enumerate(batch):
        ids[row, : len(sample.input_ids)] = torch.tensor(sample.input_ids)
    attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # [B, W]
    device = model.device
    out = model.base_model(
        input_ids=ids.to(device), attention_mask=attention_mask.to(device), output_hidden_states=True, use_cache=False
    )
    states = out.hidden_states  # L+1 tensors [B, W, H]: [k] enters layer k, [L] is after the final norm
    aux = tapped_features(states, aux_layers)  # [B, W, 3H]
    final = states[-1]  # [B, W, H]
    for row, length in enumerate(lengths.tolist()):
        yield ids[row, :length], aux[row, :length], final[row, :length]


def check_sample(sample: Sample, stored: dict[str, torch.Tensor], largest: dict[str, float]) -> str | None:
    """Why the tensors about to be stored for ``sample`` must not be trained on, or None.

    ``largest``: ``eagle3.hidden_states.storage.magnitudes(stored)`` (non-finite when a value is NaN/Inf).
    """
    if stored["input_ids"].tolist() != sample.input_ids:
        return "stored input_ids differ from the rendered conversation"
    for name, value in largest.items():
        if not math.isfinite(value):
            return f"non-finite values (NaN/Inf) in {name}"
    return None


def extract_samples(model, samples: list[Sample], settings: Settings, folder: Path | None,
                    pad_id: int) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Run, check and store ``samples`` (``folder`` None: run and check only); returns (index entries,
    rejections, sha256 of each part written)."""
    rejected = []
    progress = tqdm(total=sum(len(s.input_ids) for s in samples), desc="extract", unit="tok")
    with PartWriter(folder, settings.part_bytes) as writer:
        for batch in batches(samples, settings.batch_tokens):
            for sample, (ids, aux, final) in zip(batch, hidden_states(model, batch, settings.aux_layers, pad_id)):
                stored = encode_sample(ids, sample.loss_mask, aux, final, settings.dtype)
                largest = magnitudes(stored)
                reason = check_sample(sample, stored, largest)
                if reason is None:
                    writer.add(sample, {name: tensor.cpu() for name, tensor in stored.items()}, largest)
                else:
                    rejected.append({"id": sample.id, "record": sample.record, "reason": reason})
            progress.update(sum(len(s.input_ids) for s in batch))
    progress.close()
    return writer.index, rejected, writer.sha256


# --- scale: disk preflight and data-parallel workers ----------------------------------------------


def bytes_per_token(hidden_size: int, groups: int, dtype: str) -> int:
    """Stored bytes per token: aux (groups·H) + final (H) + input_ids (int32) + loss_mask (uint8) [+ fp8 scales]."""
    element = 2 if dtype == "bfloat16" else 1
    scales = 4 * (groups + 1) if dtype == "float8_e4m3fn" else 0
    return (groups + 1) * hidden_size * element + scales + 4 + 1


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


def device_of(device: str, rank: int) -> str:
    """Worker ``rank``'s device: ``cuda`` -> ``cuda:<rank>``; anything else as given."""
    return f"cuda:{rank}" if device == "cuda" else device


@dataclass(frozen=True)
class Job:
    """What every extraction worker shares."""

    verifier: Path
    settings: Settings
    folder: Path | None  # where the parts are written (None: not by this process)
    trust_remote_code: bool
    pad_id: int


def run_worker(rank: int, job: Job, samples: list[Sample]) -> tuple[list[dict], list[dict], dict[str, str]]:
    torch.set_num_threads(job.settings.threads)
    settings = job.settings
    model = load_verifier(job.verifier, device_of(settings.device, rank), settings.compute_dtype, job.trust_remote_code,
                          settings.placement)
    return extract_samples(model, samples, settings, job.folder, job.pad_id)


def _spawned_worker(rank: int, job: Job, samples: list[Sample], result: Path) -> None:
    """Entry point of a spawned worker: its results go to a JSON file the parent reads."""
    exit_with_launcher(worker=True)  # never outlive the stage process, even a SIGKILLed one
    index, rejected, sha256 = run_worker(rank, job, samples)
    write_json(result, {"index": index, "rejected": rejected, "sha256": sha256})


def run_workers(job: Job, samples: list[Sample]) -> tuple[list[dict], list[dict], dict[str, str]]:
    """Extract in this process, or in ``layout.extract_workers`` spawned processes, each on a contiguous slice.

    A sharded verifier is one copy over the torchrun processes this one belongs to: every process
    runs every sample (the forward is collective), and only rank 0 has a folder to write to.
    """
    workers = job.settings.workers
    if workers <= 1 or job.settings.placement.sharded:
        return run_worker(shard_rank(), job, samples)
    import torch.multiprocessing as mp

    per_worker = -(-len(samples) // workers)  # ceil
    context = mp.get_context("spawn")
    jobs = []
    for rank in range(workers):
        result = job.folder / f".worker-{rank}.json"
        mine = samples[rank * per_worker : (rank + 1) * per_worker]
        process = context.Process(target=_spawned_worker, args=(rank, job, mine, result))
        process.start()
        jobs.append((process, result))
    for process, _ in jobs:  # all of them, so that none outlives a failed sibling's cleanup
        process.join()
    failed = [rank for rank, (process, _) in enumerate(jobs) if process.exitcode != 0]
    if failed:
        raise RuntimeError(f"extract workers {failed} failed; see their logs above")
    index, rejected, sha256 = [], [], {}
    for _, result in jobs:
        part = read_json(result)
        result.unlink()
        index += part["index"]
        rejected += part["rejected"]
        sha256.update(part["sha256"])
    return index, rejected, sha256


# --- the stage ------------------------------------------------------------------------------------


def check_generated(generated: Path, fingerprint: str) -> None:
    """Refuse conversations that another verifier produced (when their meta.json says so)."""
    meta_path = generated / "meta.json"
    if not meta_path.is_file():
        return
    recorded = read_json(meta_path).get("verifier")  # generate records the fingerprint id
    if recorded is not None:
        require_verifier(str(meta_path), "generated by", recorded, fingerprint)


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
    verifier_meta = read_meta(verifier)
    fingerprint = verifier_meta["fingerprint"]["id"]
    check_generated(generated, fingerprint)
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
            "verifier": {"name": verifier_meta["name"], "fingerprint": fingerprint},
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


if __name__ == "__main__":
    stage_main(main)
