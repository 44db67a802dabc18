"""The ``sglang`` backend: start an SGLang server for the verifier, generate through it, stop it.

The server command is built from the params (``--tp``/``--dp`` from the layout, resolved into the
``backend`` section) and the verifier spec (reasoning parser, remote code, chat template:
SERVER_MODEL_KEYS); the verifier's weights folder is ``--model-path``. The server runs in its
own process group, its output goes to the stage's stderr, and it is stopped (SIGTERM, then SIGKILL) however the run ends; on Linux it also
gets SIGTERM when the stage process itself is killed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import httpx
from omegaconf import DictConfig

from eagle3.backends.base import Done, Generation, Request
from eagle3.backends.openai import OpenAIBackend
from eagle3.common import UserError
from eagle3.launch import die_with_parent
from eagle3.lm.loading import weights_dir
from eagle3.lm.spec import VerifierSpec

log = logging.getLogger(__name__)


def launch_command(cfg: DictConfig, model_path: Path, spec: VerifierSpec, chat_template: Path | None = None) -> list[str]:
    """The ``sglang.launch_server`` command line for the params' ``backend`` section and the verifier's spec.

    ``chat_template``: the verifier folder's template file, given when ``model.chat_template`` is
    set (the weights folder may be the original one, whose tokenizer lacks it).
    """
    command = [*map(str, cfg.launcher), "--model-path", str(model_path), "--host", str(cfg.host),
               "--port", str(cfg.port), "--tp", str(cfg.tp), "--dp", str(cfg.dp)]
    if chat_template is not None:
        command += ["--chat-template", str(chat_template)]
    if spec.reasoning_parser:
        command += ["--reasoning-parser", spec.reasoning_parser]
    if spec.trust_remote_code:
        command.append("--trust-remote-code")
    return command + [str(a) for a in cfg.extra_args]


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, poll: float = 0.5) -> None:
    """Poll ``url`` until it answers 200; UserError if the server exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(f"SGLang server exited with status {process.returncode} before {url} was healthy (its log is above)")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=poll).status_code == 200:
                return
        time.sleep(poll)
    raise UserError(f"SGLang server: {url} not healthy after {timeout:g} s; raise backend.health_timeout or read its log above")


def stop(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace`` seconds."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) == 0


@contextlib.contextmanager
def running_server(command: Sequence[str], host: str, port: int, health_timeout: float) -> Iterator[subprocess.Popen]:
    """Start the server in its own process group, wait for /health, stop it on the way out."""
    if port_in_use(host, port):
        raise UserError(f"{host}:{port} is already in use (a server left by a killed run?); stop it or set backend.port")
    log.info("starting SGLang: %s", shlex.join(command))
    process = subprocess.Popen(
        command, start_new_session=True, stdout=2, preexec_fn=die_with_parent
    )  # stdout=2: the server's log goes to the stage's stderr
    try:
        wait_healthy(process, f"http://{host}:{port}/health", health_timeout)
        log.info("SGLang server healthy on %s:%d", host, port)
        yield process
    finally:
        stop(process)


class SGLangBackend:
    def __init__(self, cfg: DictConfig, verifier: Path, generation: Generation, spec: VerifierSpec):
        self.cfg = cfg
        template = verifier / "chat_template.jinja" if spec.chat_template else None
        self.command = launch_command(cfg, weights_dir(verifier), spec, template)
        self.client = OpenAIBackend(cfg, generation, base_urls=[f"http://{cfg.host}:{cfg.port}/v1"])

    def run(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None:
        if all(r.id in finished for r in requests):
            return
        cfg = self.cfg
        with running_server(self.command, str(cfg.host), int(cfg.port), float(cfg.health_timeout)):
            self.client.run(requests, finished, done)
