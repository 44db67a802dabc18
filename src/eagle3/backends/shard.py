"""One prompt shard answered through a backend, resuming from its journal: the core of the
``generate`` stage (which reads its params, names the journal and writes the outputs).

    asking = Asking(tokenizer=tokenizer, generation=generation, record_params=generation_params(generation, "local"),
                    verifier=fingerprint)
    shard = generate_shard("000000-001000", read_prompts(path), backend, asking, Journal(journal_file))
    shard.records, shard.errors, shard.skipped, shard.stats   # each in the prompt shard's order

Why a module of its own: a benchmark runs the same core against a server without the stage.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from tqdm import tqdm

from eagle3.backends.base import Answer, Backend, Failure, Generation, Request, has_surrogates
from eagle3.common import UserError, sample_id, stable_hash
from eagle3.lm.chat import prompt_ids

log = logging.getLogger(__name__)


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
