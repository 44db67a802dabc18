"""Stage ``generate``: the verifier answers every prompt of one shard itself (self-distillation).

    python -m eagle3.generate models/verifier data/prompts/shards/<shard>.jsonl data/generated/<shard> \\
        --metrics metrics/generate/<shard>.json        # reads params.yaml: generate, backend, model (PARAMS)

The output folder holds ``records.jsonl`` (one conversation per prompt and answer, in the prompt
shard's order, then by answer), ``errors.jsonl`` (requests that kept failing, with the reason),
``skipped.jsonl`` (prompts never sent: longer than the context allows, text that is not valid
UTF-8, a chat the template refuses), ``stats.json`` (also written to ``--metrics`` for DVC) and
``meta.json``. answers + errors == samples x (prompts - skipped) is checked before anything is written.

``generate.samples`` answers per prompt: answer 0 at ``generate.temperature``, answer k >= 1 at
``generate.sample_temperatures[(k - 1) % len]``, each a record with its own id (answer 0's id
+ "-k") and so its own sampling seed. Answer 0's record, error and batches are exactly those of
``samples: 1``, and with ``samples: 1`` the sample keys stay out of meta.json and the journal's
key, so the outputs are byte for byte those from before the option existed.

Every finished answer is appended (and fsync'd) to a journal in ``.eagle3/journal/generate/``
named by the shard and a hash of all that determines the answers: prompt shard bytes, verifier
build, the generation settings (``generate`` params and the verifier's context, stop strings
and remote code, from its spec), and the ``backend`` params except the transport ones (URLs,
concurrency, timeouts, retries, port: TRANSPORT_KEYS) with the model keys a server it starts is
launched with. A killed run resumes from it, and the output is rebuilt in shard order, so for
deterministic settings a resumed run writes the same bytes as an uninterrupted one. Journals are kept after success (scratch, safe to delete): a rerun
that DVC asks for after a transport-only change, or ``dvc repro -f generate@<shard>`` to retry
failed requests, sends only what the journal lacks.
"""

from __future__ import annotations

if __name__ == "__main__":  # how this command's process runs (the layout's warm server, torchrun): eagle3.runner
    from eagle3.runner import run_laid_out

    run_laid_out("eagle3.generate")

import argparse
import json
import logging
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig

from eagle3.backends.by_name import make_backend
from eagle3.backends.base import Generation, server_model
from eagle3.backends.config import BackendSettings, GenerateSettings
from eagle3.backends.shard import Asking, Journal, Shard, generate_shard, generation_params, read_prompts
from eagle3.common import atomic_dir, sha256_file, stable_hash, to_plain, write_json, write_jsonl
from eagle3.lm.loading import load_tokenizer, verifier_build, verifier_fingerprint
from eagle3.lm.spec import ModelSettings, VerifierSpec
from eagle3.settings import StageParams, keys_of, section, stage_params

log = logging.getLogger(__name__)

# = dvc.yaml; the model keys: the answers' limits and, for a server the stage starts, its flags (SERVER_MODEL_KEYS)
PARAMS = StageParams(section(GenerateSettings), section(BackendSettings),  # = dvc.yaml
                     keys_of(ModelSettings, "max_position_embeddings", "stop", "trust_remote_code", "reasoning_parser", "chat_template"))

# Backend keys that change how answers are fetched, not what they are: a new server URL or a
# higher concurrency after a crash still resumes from the journal, and gives the same output bytes.
TRANSPORT_KEYS = frozenset(
    {"base_urls", "api_key_env", "concurrency", "timeout", "max_retries", "backoff", "backoff_max",
     "host", "port", "launcher", "health_timeout"}
)


def answering(backend: DictConfig, spec: VerifierSpec) -> dict:
    """The backend settings that can change an answer: its params but TRANSPORT_KEYS, and the model
    keys it starts a server with (SERVER_MODEL_KEYS)."""
    own = {k: v for k, v in to_plain(backend).items() if k not in TRANSPORT_KEYS}
    return {**own, **server_model(str(backend.name), spec)}


def settings(generation: Generation, backend: DictConfig, spec: VerifierSpec) -> dict:
    """All that decides the answers besides the prompts and the verifier: in meta.json and the journal's key.

    The sample keys only when there is more than one answer per prompt: with one they decide nothing,
    and a ``samples: 1`` shard keeps the meta.json and journal it had before the option existed.
    """
    generate = asdict(generation)
    if generation.samples == 1:
        del generate["samples"], generate["sample_temperatures"]
    return {"generate": generate, "backend": answering(backend, spec)}


def journal_path(journal_dir: Path, prompts: Path, build: str, settings: dict) -> Path:
    """``<dir>/<shard>-<hash>.jsonl``: a journal only ever resumes work that gives the same answers (the same
    verifier build: another torch's rounding may change an answer)."""
    key = stable_hash({"prompts": sha256_file(prompts), "verifier": build, **settings})
    return journal_dir / f"{prompts.stem}-{key}.jsonl"


def write_shard(out: Path, shard: Shard, meta: dict) -> None:
    with atomic_dir(out) as tmp:
        write_jsonl(tmp / "records.jsonl", shard.records)
        write_jsonl(tmp / "errors.jsonl", shard.errors)
        write_jsonl(tmp / "skipped.jsonl", shard.skipped)
        write_json(tmp / "stats.json", shard.stats)
        write_json(tmp / "meta.json", meta)


def run_stage(verifier_dir: Path, prompts_path: Path, out: Path, params: DictConfig, journal_dir: Path, metrics: Path | None) -> Shard:
    """Read the inputs, answer the shard with the configured backend, write the outputs."""
    spec = VerifierSpec.from_params(params.model)
    generation, backend_cfg = Generation.from_params(params.generate, spec), params.backend
    verifier, build = verifier_fingerprint(verifier_dir), verifier_build(verifier_dir)["id"]
    prompts = read_prompts(prompts_path)
    tokenizer = load_tokenizer(verifier_dir, generation.trust_remote_code)
    record_params = generation_params(generation, str(backend_cfg.name))
    answer_settings = settings(generation, backend_cfg, spec)
    journal = Journal(journal_path(journal_dir, prompts_path, build, answer_settings))  # answers of this build only
    try:
        backend = make_backend(backend_cfg, verifier_dir, generation, spec)
        asking = Asking(tokenizer=tokenizer, generation=generation, record_params=record_params, verifier=verifier)
        shard = generate_shard(prompts_path.stem, prompts, backend, asking, journal)
    finally:
        journal.close()
    # Transport settings stay out of the outputs: moving servers leaves the shard's bytes (and extract) alone.
    meta = {"verifier": verifier, "verifier_build": build, "prompts_sha256": sha256_file(prompts_path), **answer_settings}
    write_shard(out, shard, meta)
    if metrics:
        metrics.parent.mkdir(parents=True, exist_ok=True)
        write_json(metrics, shard.stats)
    log.info("generate %s: %s", prompts_path.stem, json.dumps(shard.stats))
    if shard.errors:
        log.warning("generate %s: %d requests failed (see %s/errors.jsonl); `dvc repro -f` retries only those",
                    prompts_path.stem, len(shard.errors), out)
    return shard


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.generate", description="the verifier answers one prompt shard")
    parser.add_argument("verifier", type=Path, help="verifier folder, e.g. models/verifier")
    parser.add_argument("prompts", type=Path, help="prompt shard, e.g. data/prompts/shards/000000-001000.jsonl")
    parser.add_argument("out", type=Path, help="output folder, e.g. data/generated/000000-001000")
    parser.add_argument("--metrics", type=Path, help="also write the shard's stats here (a DVC metric)")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--journal-dir", type=Path, default=Path(".eagle3/journal/generate"))
    args = parser.parse_args(argv)
    run_stage(args.verifier, args.prompts, args.out, stage_params(PARAMS, args.params), args.journal_dir, args.metrics)
