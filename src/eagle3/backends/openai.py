"""The ``openai`` backend: an async client for any OpenAI-compatible chat completions endpoint.

Built on ``httpx`` rather than the ``openai`` package: the answer fields that matter here are
non-standard (``reasoning_content`` from SGLang/vLLM, ``reasoning`` elsewhere) and are read from
the raw JSON, and every failure (timeout, 429, 5xx, refused connection, malformed body) is
classified and retried by one visible loop, with no second retry layer underneath.

Concurrency is bounded by ``concurrency`` workers pulling requests from one shared iterator.
Request i starts on base URL i mod n; each retry moves to the next URL. A request that still
fails after ``max_retries`` retries becomes a Failure (errors.jsonl), except when every attempt
failed to connect: the endpoint is gone, so the run stops with a UserError naming the URL and a
rerun resumes from the journal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

import httpx
from omegaconf import DictConfig

from eagle3.backends.base import Answer, Done, Failure, Generation, Request, cut_at_stop, has_surrogates, split_reasoning
from eagle3.common import UserError

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns the progress bar

T = TypeVar("T")
FINISH_REASONS = {"stop", "length"}
CONNECTION_ERRORS = (httpx.ConnectTimeout, httpx.NetworkError, httpx.RemoteProtocolError)


class Retry(Exception):
    """A retryable failure of one attempt: 429, 5xx, a malformed or empty answer."""

    def __init__(self, reason: str, wait: float | None = None):
        super().__init__(reason)
        self.wait = wait  # the server's Retry-After, if it sent one


class Refused(Exception):
    """A final failure of one request: a 4xx other than 429 (retrying cannot help)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int  # attempts = 1 + max_retries
    backoff: float  # first delay (s)
    backoff_max: float  # cap on one delay (s)

    def delay(self, retry: int, server_wait: float | None = None) -> float:
        """Seconds before retry ``retry`` (0-based): the server's wait, or full jitter up to backoff * 2^retry."""
        if server_wait is not None:
            return min(server_wait, self.backoff_max)
        return random.uniform(0, min(self.backoff_max, self.backoff * 2**retry))


def api_key(env_name: str | None) -> str | None:
    if not env_name:
        return None
    key = os.environ.get(str(env_name))
    if not key:
        raise UserError(f"params.yaml: backend.api_key_env: environment variable {env_name} is not set; export the API key in it")
    return key


def checked_json(response: httpx.Response) -> dict:
    """The JSON object of a 2xx response; Retry on 429/5xx/garbage, Refused on other 4xx."""
    status = response.status_code
    if status == 429 or status >= 500:
        raise Retry(f"HTTP {status}: {response.text[:200]}", retry_after(response))
    if status >= 400:
        raise Refused(f"HTTP {status}: {response.text[:200]}")
    try:
        body = response.json()
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise Retry(f"malformed response: not JSON ({response.content[:100]!r})") from None
    if not isinstance(body, dict):
        raise Retry("malformed response: not a JSON object")
    return body


def retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def parse_answer(body: dict, think_tags: Sequence[str] | None, stops: Sequence[str] = ()) -> Answer:
    """A chat completion body -> Answer; Retry when it is not a usable answer.

    The stop string that ended it: the one the server names (vLLM ``stop_reason``, SGLang
    ``matched_stop``), else one still in the content (a server that ignored ``stop``: cut there).
    """
    try:
        choice = body["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        content, reasoning = message.get("content") or "", message.get("reasoning_content") or message.get("reasoning")
        prompt_tokens, completion_tokens = int(body["usage"]["prompt_tokens"]), int(body["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise Retry(f"malformed response: {type(err).__name__} {err}") from None
    if finish_reason not in FINISH_REASONS:
        raise Retry(f"unusable finish_reason {finish_reason!r}")
    if not isinstance(content, str) or not isinstance(reasoning, str | None):
        raise Retry("malformed response: content is not a string")
    if has_surrogates(content) or has_surrogates(reasoning or ""):
        raise Retry("malformed response: text is not valid UTF-8")
    content, stop = cut_at_stop(content, stops)
    named = choice.get("stop_reason") or choice.get("matched_stop")
    if stop is None and finish_reason == "stop" and named in stops:
        stop = named
    if stop is not None:
        finish_reason = "stop"
    if reasoning is None:
        reasoning, content = split_reasoning(content, think_tags)
    if not content and not reasoning:  # a server glitch more often than a model's choice; whitespace counts
        raise Retry("empty answer")
    return Answer(content=content, reasoning_content=reasoning, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                  completion_tokens=completion_tokens, stop=stop)


class OpenAIBackend:
    def __init__(self, cfg: DictConfig, generation: Generation, base_urls: Sequence[str] | None = None):
        self.base_urls = [str(u).rstrip("/") for u in (base_urls or cfg.base_urls)]
        if not self.base_urls or not all(u.startswith(("http://", "https://")) for u in self.base_urls):
            raise UserError(f"params.yaml: backend.base_urls {self.base_urls}: list server URLs like http://host:8000/v1")
        self.key = api_key(cfg.api_key_env)
        self.model = cfg.model
        self.concurrency = int(cfg.concurrency)
        self.timeout = float(cfg.timeout)
        self.policy = RetryPolicy(int(cfg.max_retries), float(cfg.backoff), float(cfg.backoff_max))
        self.generation = generation
        self.stops = list(generation.stop)

    def run(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None:
        todo = [r for r in requests if r.id not in finished]
        if todo:
            asyncio.run(self.run_all(todo, done))

    async def run_all(self, todo: Sequence[Request], done: Done) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(headers=headers, timeout=self.timeout, limits=limits) as client:
            model = await self.served_model(client)
            queue = iter(enumerate(todo))  # shared by the workers: each request is taken once

            async def worker() -> None:
                for index, request in queue:
                    done(request, await self.answer(client, model, index, request))

            workers = [asyncio.create_task(worker()) for _ in range(min(self.concurrency, len(todo)))]
            try:
                await asyncio.gather(*workers)
            finally:  # after a UserError: stop the other workers; their requests stay unjournaled
                for task in workers:
                    task.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

    async def served_model(self, client: httpx.AsyncClient) -> str:
        """Check that every base URL answers ``GET /models``; backend.model or the first id listed."""
        ids = []
        for url in self.base_urls:
            result = await self.retrying(lambda u: self.first_model(client, u), [url])
            if isinstance(result, Failure):
                raise UserError(f"{url}/models: {result.reason} after {result.attempts} attempts; check backend.base_urls")
            ids.append(result)
        return str(self.model or ids[0])

    @staticmethod
    async def first_model(client: httpx.AsyncClient, url: str) -> str:
        body = checked_json(await client.get(f"{url}/models"))
        try:
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise Retry("malformed /models response (set backend.model)") from None

    async def answer(self, client: httpx.AsyncClient, model: str, index: int, request: Request) -> Answer | Failure:
        body = {
            "model": model,
            "messages": request.messages,
            "max_tokens": self.generation.max_new_tokens,
            "temperature": request.temperature,  # this answer's: generate.samples cycles it
            "top_p": self.generation.top_p,
            "seed": request.seed,
        }
        if self.stops:
            body["stop"] = list(self.stops)

        async def attempt(url: str) -> Answer:
            response = await client.post(f"{url}/chat/completions", json=body)
            return parse_answer(checked_json(response), self.generation.think_tags, self.stops)

        urls = self.base_urls[index % len(self.base_urls) :] + self.base_urls[: index % len(self.base_urls)]
        return await self.retrying(attempt, urls)

    async def retrying(self, attempt: Callable[[str], Awaitable[T]], urls: Sequence[str]) -> T | Failure:
        """``attempt(url)`` up to 1 + max_retries times, cycling through ``urls``, with backoff.

        Returns the first result or a Failure; raises UserError when every attempt failed to connect.
        """
        connected, reason, url = False, "", urls[0]
        for retry in range(self.policy.max_retries + 1):
            url, wait = urls[retry % len(urls)], None
            try:
                return await attempt(url)
            except CONNECTION_ERRORS as err:
                reason = f"connection failed ({type(err).__name__}: {err})"
            except httpx.TimeoutException:
                connected, reason = True, f"no answer within {self.timeout:g} s"
            except Retry as err:
                connected, reason, wait = True, str(err), err.wait
            except Refused as err:
                return Failure(str(err), retry + 1, url)
            if retry < self.policy.max_retries:
                log.debug("%s: %s; retry %d", url, reason, retry + 1)
                await asyncio.sleep(self.policy.delay(retry, wait))
        if not connected:
            raise UserError(
                f"{url}: unreachable after {self.policy.max_retries + 1} attempts ({reason}); start the server "
                "or fix backend.base_urls, then rerun (finished answers are journaled)"
            )
        return Failure(reason, self.policy.max_retries + 1, url)
