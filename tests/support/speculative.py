"""Speculative decoding on the tiny verifier: a table drafter (oracle or always wrong), prompts, greedy tables, a random drafter."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.drafter.model import DraftConfig, Eagle3Drafter
from eagle3.decoding.speculative import greedy_decode
from eagle3.lm.chat import prompt_ids
from support.tiny_drafter import draft_d2t

K = 4  # draft steps per round
TINY_TAPS = (1, 2, 3)  # the tiny verifier's tap layers
QUESTIONS = ["Hello there, how are you?", "Write a short poem about the sea.", "def fibonacci(n):"]


class TableDrafter(nn.Module):
    """Proposes table[b, p + 2] at RoPE position p (the alignment: position p predicts x_{p+2}).

    With the verifier's own greedy sequences as the table it is an oracle; with shifted ones always
    wrong. ``runner_up``: where set, the table token is only the second choice, after table + 1.
    """

    def __init__(self, table: torch.Tensor, vocab_size: int, runner_up: torch.Tensor | None = None):
        super().__init__()
        self.fc = nn.Identity()
        self.table, self.vocab_size = torch.atleast_2d(table), vocab_size  # [B, L]
        self.runner_up = runner_up
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))  # draft vocab = target vocab

    def step(self, input_ids, hidden, position_ids, cache, rows=None):
        h2 = hidden.clone()
        h2[..., 0] = position_ids.float()  # the logits call reads the position back
        return h2

    def logits(self, h2):
        index = (h2[..., 0].long() + 2).clamp(max=self.table.shape[1] - 1)  # [B, T]
        right = self.table.gather(1, index)
        logits = 10 * F.one_hot(right, self.vocab_size).float()
        if self.runner_up is not None:  # a close wrong first choice at the marked positions
            wrong = F.one_hot((right + 1) % self.vocab_size, self.vocab_size).float()
            logits = torch.where(self.runner_up[index][..., None], 2 * wrong + 1.9 * logits / 10, logits)
        return logits


def encode(tokenizer, question: str) -> torch.Tensor:
    return torch.tensor(prompt_ids(tokenizer, [{"role": "user", "content": question}]))  # [n]


def greedy_tables(verifier, prompts, length: int) -> torch.Tensor:
    """Per prompt, prompt + ``length`` greedy tokens ignoring EOS, right-padded: [B, L]."""
    rows = [torch.cat([p, torch.tensor(g)]) for p, g in zip(prompts, greedy_decode(verifier, prompts, length, set()))]
    return torch.stack([F.pad(r, (0, max(map(len, rows)) - len(r))) for r in rows])


def random_drafter(verifier, draft_vocab: int, taps, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DraftConfig.from_verifier(verifier.config, draft_vocab, taps)
    drafter = Eagle3Drafter(cfg, verifier.get_input_embeddings().weight)
    drafter.set_draft_vocab(draft_d2t(cfg.vocab_size, draft_vocab))
    return drafter.eval()
