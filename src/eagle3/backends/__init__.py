"""Generation backends: how the ``generate`` stage gets the verifier's answers.

A backend takes the shard's requests and calls ``done(request, result)`` once per request it
finishes, as soon as it finishes it (the stage journals each result right away). Requests whose
id is in ``finished`` were answered by an earlier, interrupted run: a backend skips them, but may
recompute them when that keeps its other results identical (the local backend re-runs a whole
batch, because a row's numerics depend on its batch-mates' padding).

- ``local``: in-process transformers on the layout's device (the embedded default);
- ``openai``: any OpenAI-compatible endpoint (SGLang, vLLM, ``transformers serve``, hosted APIs);
- ``sglang``: starts an SGLang server with the layout's TP, then talks to it as ``openai`` does.

``base`` holds what they share (requests, answers, the protocol); ``make_backend`` picks one by name;
``shard`` answers one prompt shard through a backend, resuming from its journal (the stage's core).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from eagle3.backends.base import Backend, Generation
from eagle3.common import UserError
from eagle3.lm.spec import VerifierSpec


def make_backend(cfg: DictConfig, verifier: Path, generation: Generation, spec: VerifierSpec) -> Backend:
    """The backend named by ``cfg.name`` (the params' ``backend`` section)."""
    if cfg.name == "local":
        from eagle3.backends.local import LocalBackend

        return LocalBackend(cfg, verifier, generation)
    if cfg.name == "openai":
        from eagle3.backends.openai import OpenAIBackend

        return OpenAIBackend(cfg, generation)
    if cfg.name == "sglang":
        from eagle3.backends.sglang import SGLangBackend

        return SGLangBackend(cfg, verifier, generation, spec)
    raise UserError(f"params.yaml: backend.name: {cfg.name!r} is not one of local, openai, sglang")
