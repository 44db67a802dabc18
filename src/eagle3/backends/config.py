"""The ``backend`` and ``generate`` params sections' schemas: the keys of every backend's options
(local, openai, sglang), and how the verifier answers (read into ``base.Generation``).

    check_schema(BackendSettings, get)    # config.validate, for every view holding backend keys
    check_schema(GenerateSettings, get)   # and generate keys

Apart from the backends themselves: ``eagle3.config`` validates every view with it and imports
nothing heavier (no torch, no HTTP client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3.schema import (ABSENT, BOOL, FRACTION_ABOVE_0, NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE, POSITIVE_NUMBER,
                           Check, Lookup, integer, number, or_null, refuse, setting)

TOKEN_BUDGET = Check(or_null(integer(1)), "an integer >= 1, or null for no token budget")
CACHE_SHARE = Check(FRACTION_ABOVE_0.test, f"{FRACTION_ABOVE_0.allowed}: the share of the GPU memory free")
PORT = Check(lambda v: integer(1)(v) and v < 65536, "a port number in [1, 65535]")
TEMPERATURES = Check(lambda v: isinstance(v, list) and bool(v) and all(number(0)(t) for t in v),
                     "a non-empty list of numbers >= 0 (cycled over the answers after the first)")


@dataclass(frozen=True)
class BackendSettings:
    """One field per key of conf/backend/*.yaml, the union over the options (read by ``local``,
    ``openai`` and ``sglang``); device, dtype and threads are the layout's, checked there."""

    GROUP: ClassVar[str] = "backend"

    # local: in-process transformers
    batch_size: int = setting(POSITIVE)  # most prompts per batch (or slot cache)
    batch_tokens: int | None = setting(TOKEN_BUDGET)  # most KV-cache tokens per batch, rows x (padded prompt + max_new_tokens)
    pad_multiple: int = setting(POSITIVE)  # left-pad each batch to a multiple of this many tokens
    device: str = setting()  # layout.device's value
    dtype: str = setting()  # layout.dtype's value
    threads: int = setting()  # layout.threads' value
    cuda_graphs: bool = setting(BOOL)  # CUDA, greedy or sampled: slot KV cache + decode steps as CUDA graphs
    cache_memory: float = setting(CACHE_SHARE)  # share of the GPU memory free after loading the verifier that slot decoding's cache takes
    # openai: any OpenAI-compatible endpoint (and sglang's client)
    base_urls: list = setting()  # servers of the same verifier, each ending in /v1
    model: str | None = setting()  # served model name; null: the first the server lists
    api_key_env: str | None = setting()  # environment variable holding the API key; null: no key
    concurrency: int = setting(POSITIVE)  # requests in flight at once, over all base URLs
    timeout: float = setting(POSITIVE_NUMBER)  # seconds one request may take
    max_retries: int = setting(NON_NEGATIVE)  # retries after the first attempt
    backoff: float = setting(NON_NEGATIVE_NUMBER)  # first retry delay (s), doubling per retry
    backoff_max: float = setting(NON_NEGATIVE_NUMBER)  # cap on one retry delay (s)
    # sglang: a server this host starts and owns
    launcher: list = setting()  # command prefix of the server
    host: str = setting()  # where the server listens
    port: int = setting(PORT)  # where the server listens, with host
    tp: int = setting()  # layout.server.tp's value
    dp: int = setting()  # layout.server.dp's value
    health_timeout: float = setting(POSITIVE_NUMBER)  # seconds to wait for /health
    extra_args: list = setting()  # more launch_server flags


@dataclass(frozen=True)
class GenerateSettings:
    """One field per key of conf/generate/*.yaml (read into ``base.Generation``, which also takes the verifier's
    context, stop strings and remote code from the model's spec)."""

    GROUP: ClassVar[str] = "generate"

    max_new_tokens: int = setting(POSITIVE)  # answer length cap (relations: below the verifier's context)
    temperature: float = setting(NON_NEGATIVE_NUMBER, read=float)  # of a prompt's first answer: 0 greedy
    top_p: float = setting(FRACTION_ABOVE_0, read=float)  # nucleus sampling mass
    seed: int = setting()  # the top-level seed's value, checked there
    samples: int = setting(POSITIVE)  # answers per prompt, each its own record
    sample_temperatures: tuple[float, ...] = setting(TEMPERATURES, read=lambda v: tuple(float(t) for t in v))  # of the answers after the first, cycled
    think_tags: tuple[str, str] | None = setting(read=lambda v: None if v is None else tuple(str(t) for t in v))  # raw reasoning markup split out of an answer; null: never split

    @staticmethod
    def relations(get: Lookup) -> None:
        """An answer fits the verifier's context, and at most one answer to a prompt is greedy."""
        context, new = get("model.max_position_embeddings"), get("generate.max_new_tokens")
        if ABSENT not in (context, new) and context <= new:
            raise refuse("generate.max_new_tokens", new, f"smaller than model.max_position_embeddings ({context}), the verifier's context")
        _check_sample_temperatures(get("generate.samples"), get("generate.temperature"), get("generate.sample_temperatures"))


def _check_sample_temperatures(samples: Any, first: Any, others: Any) -> None:
    """Greedy decoding gives one answer, so a second greedy answer to a prompt would be its copy."""
    if ABSENT in (samples, first, others):
        return
    temperatures = [first] + [others[(k - 1) % len(others)] for k in range(1, samples)]
    greedy = [k for k, t in enumerate(temperatures) if t == 0]
    if len(greedy) > 1:
        raise refuse("generate.sample_temperatures", others,
                     f"free of 0 for the {samples} answers of generate.samples: answers {greedy} would be at temperature 0 "
                     "(answer 0 at generate.temperature), one greedy answer repeated")
