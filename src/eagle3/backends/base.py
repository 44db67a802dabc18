"""What every generation backend shares: the settings of an answer (``Generation``), a request and its
result (``Request``, ``Answer``, ``Failure``), the ``Backend`` protocol the ``generate`` stage drives,
and the text rules every backend applies (reasoning split, stop strings, undecodable text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from omegaconf import DictConfig

from eagle3.backends.config import GenerateSettings
from eagle3.lm.spec import VerifierSpec
from eagle3.schema import read_section

# The model keys a backend that starts its own server launches it with (sglang: --reasoning-parser,
# --trust-remote-code, --chat-template): they change its answers, so they count as its settings.
SERVER_MODEL_KEYS = {"sglang": ("reasoning_parser", "trust_remote_code", "chat_template")}


@dataclass(frozen=True)
class Generation:
    """How the verifier answers: the ``generate`` params, and what its spec says about the verifier."""

    name: str  # generate.name: the conf/generate file
    max_new_tokens: int  # generate.max_new_tokens
    temperature: float  # generate.temperature: each record seeded from its id
    top_p: float  # generate.top_p
    seed: int  # generate.seed
    think_tags: tuple[str, str] | None  # generate.think_tags
    context: int  # prompt + answer limit: model.max_position_embeddings
    stop: tuple[str, ...]  # model.stop
    trust_remote_code: bool  # model.trust_remote_code
    samples: int  # generate.samples
    sample_temperatures: tuple[float, ...]  # generate.sample_temperatures

    @classmethod
    def from_params(cls, generate: DictConfig, spec: VerifierSpec) -> Generation:
        """The ``generate`` section, read as ``GenerateSettings`` declares it, and the model keys of ``spec``."""
        return cls(name=str(generate.name), **vars(read_section(GenerateSettings, generate)), context=spec.max_position_embeddings,
                   stop=spec.stop, trust_remote_code=spec.trust_remote_code)

    def temperature_of(self, sample: int) -> float:
        """Answer 0 of a prompt samples at ``temperature``, answer k >= 1 at ``sample_temperatures[(k - 1) % len]``.

        Example: temperature 0, cycle (0.7, 1.0), 4 samples -> 0 (greedy), 0.7, 1.0, 0.7.
        """
        if sample == 0:
            return self.temperature
        return self.sample_temperatures[(sample - 1) % len(self.sample_temperatures)]


def server_model(backend: str, spec: VerifierSpec) -> dict:
    """The model keys the backend named ``backend`` starts its server with (SERVER_MODEL_KEYS), read from ``spec``."""
    return {key: getattr(spec, key) for key in SERVER_MODEL_KEYS.get(backend, ())}


@dataclass(frozen=True)
class Request:
    """One answer to get: answer ``sample`` of a prompt."""

    id: str  # record id: hash of the prompt id, the verifier and the generation params (+ "-<sample>" after answer 0)
    prompt_id: str
    messages: list[dict]  # chat ending with a user turn
    prompt_ids: list[int]  # the messages under the verifier's chat template + generation prompt
    seed: int  # sampling seed of this record (derived from its id)
    temperature: float = 0.0  # this answer's: Generation.temperature_of(sample); 0: greedy
    sample: int = 0  # which answer to the prompt: 0 .. generate.samples - 1


@dataclass(frozen=True)
class Answer:
    content: str
    reasoning_content: str | None  # None: the model gave no separate reasoning
    finish_reason: str  # "stop" (end of sequence) or "length" (max_new_tokens reached)
    prompt_tokens: int
    completion_tokens: int  # generated tokens, the stop token included (as servers count them)
    stop: str | None = None  # the model.stop string that ended the answer (not in content); None: EOS or length


@dataclass(frozen=True)
class Failure:
    reason: str  # what the last attempt saw, e.g. "HTTP 500: ..." or "timeout after 600 s"
    attempts: int
    url: str | None = None  # the endpoint of the last attempt


Done = Callable[[Request, Answer | Failure], None]


class Backend(Protocol):
    def run(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None: ...


def split_reasoning(text: str, tags: Sequence[str] | None) -> tuple[str | None, str]:
    """``"<think>r</think>a"`` -> ``("r", "a")``: raw reasoning markup a server left in the content.

    Also handles the open tag living in the prompt (output ``"r</think>a"``) and an answer cut
    inside its reasoning (``"<think>r"`` -> ``("r", "")``). Text without tags is all content.
    """
    if not tags:
        return None, text
    start, end = tags
    head, closed, tail = text.partition(end)
    if closed:
        return head.strip().removeprefix(start).strip(), tail.strip()
    if text.lstrip().startswith(start):
        return text.lstrip().removeprefix(start).strip(), ""
    return None, text


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to the earliest stop string, and that string (None when none occurs).

    Example: ``cut_at_stop("4.\nUser: and", ["\nUser:"])`` -> ``("4.", "\nUser:")``. Servers cut
    there themselves; this also covers one that ignores the API's ``stop``.
    """
    found = [(at, stop) for stop in stops if (at := text.find(stop)) >= 0]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


SURROGATES = re.compile("[\ud800-\udfff]")


def has_surrogates(text: str) -> bool:
    """True if ``text`` cannot be written as UTF-8: undecodable input bytes (kept as lone
    surrogates by ``surrogateescape``) or a lone ``\\udXXX`` escape in JSON."""
    return SURROGATES.search(text) is not None
