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

import argparse
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from omegaconf import DictConfig
from tqdm import tqdm

from eagle3.backends import make_backend
from eagle3.backends.base import Answer, Backend, Failure, Generation, Request, has_surrogates, server_model
from eagle3.common import UserError, atomic_dir, sample_id, sha256_file, stable_hash, stage_main, to_plain, write_json, write_jsonl
from eagle3.config import stage_params
from eagle3.lm.chat import prompt_ids
from eagle3.lm.loading import load_tokenizer, verifier_build, verifier_fingerprint
from eagle3.lm.spec import VerifierSpec

log = logging.getLogger(__name__)

# = dvc.yaml; the model keys: the answers' limits and, for a server the stage starts, its flags (SERVER_MODEL_KEYS)
PARAMS = ("generate", "backend", "model.max_position_embeddings", "model.stop", "model.trust_remote_code",
          "model.reasoning_parser", "model.chat_template")

# Backend keys that change how answers are fetched, not what they are: a new server URL or a
# higher concurrency after a crash still resumes from the journal, and gives the same output bytes.
TRANSPORT_KEYS = frozenset(
    {"base_urls", "api_key_env", "concurrency", "timeout", "max_retries", "backoff", "backoff_max",
     "host", "port", "launcher", "health_timeout"}
)


@dataclass
class Shard:
    """The result of one shard, each list in the prompt shard's order."""

    records: list[dict]
    errors: list[dict]
    skipped: list[dict]
    stats: dict


class Journal:
    """Finished records of one shard, keyed by record id, appended and fsync'd one per line."""

    def __init__(self, path: Path):
        self.path = path
        self.records = self.load()
        self.handle = None

    def load(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) < len(data):  # a kill in the middle of a write leaves a partial last line
            with self.path.open("r+b") as handle:
                handle.truncate(len(complete))
        try:
            records = [json.loads(line) for line in complete.splitlines()]
        except json.JSONDecodeError:
            raise UserError(f"{self.path}: corrupt journal; delete it to generate this shard from the start") from None
        return {record["id"]: record for record in records}

    def append(self, record: dict) -> None:
        if self.handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = self.path.open("a", encoding="utf-8")
        self.handle.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.records[record["id"]] = record

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def read_prompts(path: Path) -> list[dict]:
    """The prompt records of a shard. Undecodable bytes are kept as lone surrogates (then skipped)."""
    prompts, seen = [], set()
    try:
        lines = path.read_bytes().splitlines()
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror})") from None
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8", "surrogateescape"))
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number}: malformed JSON line ({err}); rebuild the prompts stage") from None
        problem = prompt_problem(record)
        if problem:
            raise UserError(f"{path}:{number}: {problem}; rebuild the prompts stage")
        if record["id"] in seen:
            raise UserError(f"{path}:{number}: duplicate prompt id {record['id']}")
        seen.add(record["id"])
        prompts.append(record)
    if not prompts:
        raise UserError(f"{path}: no prompts; check the prompts stage's dataset settings")
    return prompts


def prompt_problem(record) -> str | None:
    """What makes ``record`` not a prompt record ({id, source, messages ending with a user turn})."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        return "expected a prompt record with a string 'id'"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list"
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
        return "every message needs a string 'role' and 'content'"
    if messages[-1]["role"] != "user":
        return "the last message must be a user turn"
    return None


def generation_params(generation: Generation, backend_name: str) -> dict:
    """What decides an answer's tokens (besides prompt and verifier): part of every record id."""
    return {
        "backend": backend_name,
        "max_new_tokens": generation.max_new_tokens,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "seed": generation.seed,  # the base; each record samples with a seed derived from its id
        **({"stop": list(generation.stop)} if generation.stop else {}),  # absent when unused: ids stay as before
    }


@dataclass(frozen=True)
class Asking:
    """How a shard's prompts become requests, and what each record of an answer carries."""

    tokenizer: Any  # renders a prompt under the verifier's chat template (lm.chat.prompt_ids)
    generation: Generation
    record_params: dict  # generation_params: in every record, and hashed into its id
    verifier: str  # the verifier's fingerprint, hashed into every record id


def plan(prompts: Sequence[dict], asking: Asking) -> tuple[list[Request], dict[str, dict]]:
    """Requests for the prompts that can be sent (``generation.samples`` each, in prompt then answer order),
    and skip records (by prompt id) for the others."""
    tokenizer, generation, record_params, verifier = asking.tokenizer, asking.generation, asking.record_params, asking.verifier
    requests, skipped = [], {}
    limit = generation.context - generation.max_new_tokens
    for prompt in prompts:
        skip = {"prompt_id": prompt["id"], "source": prompt.get("source")}
        if any(has_surrogates(m["content"]) for m in prompt["messages"]):
            skipped[prompt["id"]] = {**skip, "reason": "invalid_text", "detail": "a message is not valid UTF-8 text"}
            continue
        try:
            ids = prompt_ids(tokenizer, prompt["messages"])
        except TemplateError as err:
            skipped[prompt["id"]] = {**skip, "reason": "template_error", "detail": str(err)}
            continue
        if len(ids) > limit:
            detail = f"{len(ids)} prompt tokens + {generation.max_new_tokens} new tokens > context {generation.context}"
            skipped[prompt["id"]] = {**skip, "reason": "too_long", "detail": detail}
            continue
        first_id = stable_hash({"prompt_id": prompt["id"], "verifier": verifier, **record_params})
        for sample in range(generation.samples):
            record_id = sample_id(first_id, sample)
            seed = int(stable_hash({"sampling_seed": record_id}, 8), 16)  # 32 bits, fixed by the record id
            temperature = generation.temperature_of(sample)
            requests.append(Request(id=record_id, prompt_id=prompt["id"], messages=prompt["messages"], prompt_ids=ids, seed=seed,
                                    temperature=temperature, sample=sample))
    return requests, skipped


def sample_fields(request: Request) -> dict:
    """Which answer a record or error is, after a prompt's first: absent for answer 0, so it reads as with ``samples: 1``."""
    return {"sample": request.sample, "temperature": request.temperature} if request.sample else {}


def to_record(prompt: dict, request: Request, answer: Answer, record_params: dict) -> dict:
    assistant = {"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning_content}
    return {
        "id": request.id,
        "prompt_id": prompt["id"],
        "source": prompt.get("source"),
        "messages": [*prompt["messages"], assistant],
        "finish_reason": answer.finish_reason,
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "generation": {**record_params, **sample_fields(request), "seed": request.seed},  # this record's own sampling seed
        **({"stop": answer.stop} if answer.stop is not None else {}),  # the stop string that ended it (extract masks it)
    }


class Progress:
    """A tqdm bar over requests showing this run's generated tokens/s and the error count."""

    def __init__(self, name: str, total: int, initial: int):
        self.bar = tqdm(total=total, initial=initial, desc=f"generate {name}", unit="req", dynamic_ncols=True)
        self.start, self.tokens, self.errors = time.monotonic(), 0, 0

    def update(self, result: Answer | Failure) -> None:
        if isinstance(result, Failure):
            self.errors += 1
        else:
            self.tokens += result.completion_tokens
        self.bar.set_postfix(tok_s=f"{self.tokens / (time.monotonic() - self.start):.1f}", errors=self.errors, refresh=False)
        self.bar.update()

    def close(self) -> float:
        """Close the bar; returns this run's tokens/s."""
        self.bar.close()
        return self.tokens / max(time.monotonic() - self.start, 1e-9)


def generate_shard(name: str, prompts: Sequence[dict], backend: Backend, asking: Asking, journal: Journal) -> Shard:
    """Pure core: answer the shard's prompts through ``backend``, resuming from ``journal``."""
    requests, skipped = plan(prompts, asking)
    record_params = asking.record_params
    prompt_of = {p["id"]: p for p in prompts}
    finished = {r.id for r in requests if r.id in journal.records}
    if finished:
        log.info("generate %s: resuming with %d of %d answers journaled", name, len(finished), len(requests))
    errors: dict[tuple[str, int], dict] = {}
    progress = Progress(name, len(requests), len(finished))

    def done(request: Request, result: Answer | Failure) -> None:
        prompt = prompt_of[request.prompt_id]
        if request.id in journal.records:  # a re-run batch repeats journaled answers: keep those
            return
        if isinstance(result, Failure):
            errors[prompt["id"], request.sample] = {
                "prompt_id": prompt["id"], "source": prompt.get("source"), **sample_fields(request),
                "reason": result.reason, "attempts": result.attempts, "url": result.url,
            }
        else:
            journal.append(to_record(prompt, request, result, record_params))
        progress.update(result)

    try:
        backend.run(requests, finished, done)
    finally:
        tokens_per_s = progress.close()
    log.info("generate %s: %.1f generated tokens/s in this run", name, tokens_per_s)
    answered = {(r.prompt_id, r.sample): journal.records[r.id] for r in requests if r.id in journal.records}
    return assemble(prompts, asking.generation.samples, answered, errors, skipped)


def assemble(prompts: Sequence[dict], samples: int, answered: dict, errors: dict, skipped: dict) -> Shard:
    """Each outcome table as a list in shard order, then by answer; every answer of a prompt has exactly one outcome.

    ``answered`` and ``errors`` are keyed by (prompt id, sample), ``skipped`` by prompt id: a skipped
    prompt's one skip record is the outcome of all its answers (it was never sent).
    """
    tables = {"records": answered, "errors": errors, "skipped": skipped}
    lists: dict[str, list[dict]] = {kind: [] for kind in tables}
    for prompt in prompts:
        for sample in range(samples):
            keys = {"records": (prompt["id"], sample), "errors": (prompt["id"], sample), "skipped": prompt["id"]}
            found = [(kind, tables[kind][key]) for kind, key in keys.items() if key in tables[kind]]
            if len(found) != 1:
                raise RuntimeError(f"accounting: prompt {prompt['id']} answer {sample} has {len(found)} outcomes instead of one")
            kind, outcome = found[0]
            if kind != "skipped" or sample == 0:
                lists[kind].append(outcome)
    return Shard(**lists, stats=shard_stats(len(prompts), samples, **lists))


def shard_stats(prompts: int, samples: int, records: list[dict], errors: list[dict], skipped: list[dict]) -> dict:
    """The shard's metrics: answers + errors == samples x (prompts - skipped); ``samples`` only when > 1 (as before the option)."""
    return {
        "prompts": prompts,
        **({"samples": samples} if samples > 1 else {}),
        "answers": len(records),
        "errors": len(errors),
        "skipped": len(skipped),
        "skip_reasons": dict(sorted(Counter(s["reason"] for s in skipped).items())),
        "finish_reasons": dict(sorted(Counter(r["finish_reason"] for r in records).items())),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "completion_tokens": sum(r["completion_tokens"] for r in records),
        "with_reasoning": sum(r["messages"][-1]["reasoning_content"] is not None for r in records),
    }


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


if __name__ == "__main__":
    stage_main(main)
