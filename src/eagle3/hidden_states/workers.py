"""Extraction at scale: ``layout.extract_workers`` spawned processes, one per device, each on a
contiguous slice of the samples, or every process of a sharded verifier on all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.common import read_json, write_json
from eagle3.launch import exit_with_launcher
from eagle3.hidden_states.capture import Settings, extract_samples
from eagle3.hidden_states.samples import Sample
from eagle3.lm.loading import load_verifier, prepare_torch, shard_rank


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
    settings = job.settings
    prepare_torch(settings.device, settings.threads)  # cuDNN's SDPA off on CUDA: batches of sorted lengths are new shapes
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
