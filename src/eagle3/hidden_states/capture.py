"""The verifier forward of extract: batches of similar lengths through the decoder (no lm_head), each
sample's tapped and final states encoded in the storage format, checked, and written to parts.

``aux[:, i*H:(i+1)*H]`` is the residual stream *entering* decoder layer ``aux_layers[i]`` (HF
``output_hidden_states[aux_layers[i]]``, index 0 = embedding output); ``final`` is HF's last hidden
state, *after* the final norm.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.common import Spent, UserError
from eagle3.hidden_states.config import ExtractSettings
from eagle3.hidden_states.samples import Sample
from eagle3.hidden_states.storage import PartWriter, decode_states, encode_states
from eagle3.lm.loading import Placement
from eagle3.lm.spec import VerifierSpec, tapped_features
from eagle3.schema import read_section

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """What ``extract`` reads from params: its section, the taps, and the layout."""

    name: str  # extract.name: the conf/extract file
    aux_layers: tuple[int, ...]  # model.aux_layers: HF hidden_states indices
    dtype: str  # extract.dtype
    max_length: int  # extract.max_length
    batch_tokens: int  # extract.batch_tokens
    part_bytes: int  # extract.part_bytes
    device: str  # layout.device (worker r takes cuda:r)
    compute_dtype: str  # layout.dtype: the verifier's dtype for the forward
    workers: int  # layout.extract_workers
    threads: int  # layout.threads
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
            name=str(extract.name), **vars(read_section(ExtractSettings, extract)),
            aux_layers=VerifierSpec.from_params(params.model).aux_layers,
            device=layout.device, compute_dtype=layout.dtype, workers=int(layout.extract_workers), threads=int(layout.threads),
            placement=placement,
        )

    def section(self) -> dict[str, Any]:
        """The ``extract`` params as read (meta.json's ``params``): the conf/extract file's name and every key."""
        return {"name": self.name, **{item.name: getattr(self, item.name) for item in fields(ExtractSettings)}}


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
def hidden_states(model, batch: list[Sample], aux_layers: tuple[int, ...], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder forward over a right-padded batch: ``(input_ids [B, W] on the host, aux [B, W, 3H], final [B, W, H])``.

    Right padding leaves the real tokens' states unchanged (causal attention never looks right,
    positions start at 0), so row b's first ``len(batch[b].input_ids)`` positions are its sample's
    states. The base model is called, not the CausalLM: no lm_head over every position. ``aux`` and
    ``final`` stay on the verifier's device (in its dtype), so that encoding and checks run there too.
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
    return ids, tapped_features(states, aux_layers), states[-1]


@torch.inference_mode()
def stored_samples(batch: list[Sample], ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                   dtype: str) -> Iterator[tuple[Sample, dict[str, torch.Tensor], dict[str, float]]]:
    """Each sample of a forward's batch (``hidden_states``) with its stored tensors on the host (``encode_states``,
    views of the batch's) and their magnitudes: the largest |value| of the decoded ``aux`` and ``final`` of each
    sample's tokens (NaN or inf when one is not finite).

    The whole batch is encoded and measured on the verifier's device at once, padding masked out of the magnitudes,
    then copied to the host in one transfer a tensor: one host sync a forward, not a few a sample."""
    rows, width = ids.shape
    groups = aux.shape[-1] // final.shape[-1]
    encoded = {**encode_states("aux", aux.flatten(0, 1), dtype, groups), **encode_states("final", final.flatten(0, 1), dtype, 1)}
    lengths = torch.tensor([len(s.input_ids) for s in batch])
    padding = (torch.arange(width)[None, :] >= lengths[:, None]).to(aux.device)  # [B, W]
    largest = torch.stack([decode_states(encoded, name).abs().amax(dim=1).view(rows, width).masked_fill(padding, 0).amax(dim=1)
                           for name in ("aux", "final")], dim=1).tolist()  # [B, 2]: one host sync
    host = {name: tensor.view(rows, width, *tensor.shape[1:]).cpu() for name, tensor in encoded.items()}
    for row, sample in enumerate(batch):
        n = len(sample.input_ids)
        stored = {"input_ids": ids[row, :n].to(torch.int32), "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8),
                  **{name: tensor[row, :n] for name, tensor in host.items()}}
        yield sample, stored, dict(zip(("aux", "final"), largest[row]))


def check_sample(sample: Sample, stored: dict[str, torch.Tensor], largest: dict[str, float]) -> str | None:
    """Why the tensors about to be stored for ``sample`` must not be trained on, or None.

    ``largest``: the magnitudes of ``stored_samples`` (non-finite when a value is NaN/Inf).
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
    rejected, spent = [], Spent()
    progress = tqdm(total=sum(len(s.input_ids) for s in samples), desc="extract", unit="tok")
    with PartWriter(folder, settings.part_bytes, spent=spent) as writer:
        for batch in batches(samples, settings.batch_tokens):
            with spent.on("queueing forwards"):
                states = hidden_states(model, batch, settings.aux_layers, pad_id)
            with spent.on("encoding and copying to the host"):  # on a GPU the first host sync waits for the forward
                stored_batch = list(stored_samples(batch, *states, settings.dtype))
            for sample, stored, largest in stored_batch:
                with spent.on("checking samples"):
                    reason = check_sample(sample, stored, largest)
                if reason is None:
                    writer.add(sample, stored, largest)  # waits for a part writer when all are busy (timed there)
                else:
                    rejected.append({"id": sample.id, "record": sample.record, "reason": reason})
            progress.update(sum(len(s.input_ids) for s in batch))
    progress.close()
    # where the wall time went: a GPU far from busy with little "waiting for part writers" is host-bound here
    log.info("capture and storage: %s", spent.summary())
    return writer.index, rejected, writer.sha256
