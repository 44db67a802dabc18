"""The ``backend`` params section's schema: the keys of every backend's options (local, openai,
sglang), each checked where a view holds it.

    check_schema(BackendSettings, get)    # config.validate, for every view holding backend keys

Apart from the backends themselves: ``eagle3.config`` validates every view with it and imports
nothing heavier (no torch, no HTTP client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.schema import (BOOL, FRACTION_ABOVE_0, NON_NEGATIVE, NON_NEGATIVE_NUMBER, POSITIVE, POSITIVE_NUMBER, Check,
                           integer, setting)


@dataclass(frozen=True)
class BackendSettings:
    """One field per key of conf/backend/*.yaml, the union over the options (read by ``local``,
    ``openai`` and ``sglang``); device, dtype and threads are the layout's, checked there."""

    GROUP: ClassVar[str] = "backend"

    # local: in-process transformers
    batch_size: int = setting(POSITIVE)  # most prompts per batch (or slot cache)
    batch_tokens: int | None = setting(Check(lambda v: v is None or integer(1)(v), "an integer >= 1, or null for no token budget"))
    pad_multiple: int = setting(POSITIVE)  # left-pad each batch to a multiple of this many tokens
    device: str = setting()  # layout.device's value
    dtype: str = setting()  # layout.dtype's value
    threads: int = setting()  # layout.threads' value
    cuda_graphs: bool = setting(BOOL)  # CUDA, greedy: slot KV cache + decode steps as CUDA graphs
    cache_memory: float = setting(Check(FRACTION_ABOVE_0.test, f"{FRACTION_ABOVE_0.allowed}: the share of the GPU memory free"))
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
    port: int = setting(Check(lambda v: integer(1)(v) and v < 65536, "a port number in [1, 65535]"))
    tp: int = setting()  # layout.server.tp's value
    dp: int = setting()  # layout.server.dp's value
    health_timeout: float = setting(POSITIVE_NUMBER)  # seconds to wait for /health
    extra_args: list = setting()  # more launch_server flags
