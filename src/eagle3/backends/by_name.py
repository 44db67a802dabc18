"""The backend the params' ``backend.name`` names, its module imported only when chosen.

    backend = make_backend(params.backend, verifier, generation, spec)
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
