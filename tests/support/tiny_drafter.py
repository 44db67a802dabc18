"""A tiny random drafter, verifier head and batch of the shapes `eagle3.hidden_states.loader` yields (for fast tests)."""

from __future__ import annotations

import pytest
import torch

from eagle3.drafter.model import DraftConfig, Eagle3Drafter


# Tiny shapes for unit tests and CPU smoke runs.
DEBUG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             draft_vocab_size=128, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
             aux_layers=(1, 2, 3))


def make_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    """The ``DEBUG`` shape with random weights, non-trivial norms and a spread-out draft vocab."""
    torch.manual_seed(seed)
    cfg = DraftConfig.create(DEBUG, overrides)
    drafter = Eagle3Drafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size))
    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, cfg.draft_vocab_size))
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter.eval()


def draft_d2t(vocab: int, draft: int) -> torch.Tensor:
    """d2t of a draft vocabulary of every (vocab // draft)-th token: target id = i + d2t[i]."""
    return torch.arange(draft) * (vocab // draft) - torch.arange(draft)


def random_batch(cfg: DraftConfig, batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids [B, T], loss_mask [B, T], aux [B, T, 3H], final [B, T, H] (a prompt-then-answer mask)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.long)
    mask[:, length // 4 :] = 1
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, length), generator=g),
        "loss_mask": mask,
        "aux": torch.randn(batch, length, 3 * cfg.hidden_size, generator=g),
        "final": torch.randn(batch, length, cfg.hidden_size, generator=g),
    }


def verifier_head_weight(cfg: DraftConfig, d2t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A random lm_head [V, H] whose argmax is usually, not always, a draft token."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    weight[torch.arange(len(d2t)) + d2t] *= 1.4
    return weight


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads run several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
