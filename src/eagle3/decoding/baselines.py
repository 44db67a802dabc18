"""The history-only baselines of ``evaluate``: the set's most frequent output token K times (the best
context-free chain drafter) and prompt lookup (``ngram``, as vLLM and SGLang ship it).

    baselines(prompts, greedy_outputs, k=3)   # {"baseline": {"tau", ..., "token"}, "ngram": {"tau", ...}}
    speculative_decode(Target(verifier=verifier, layer_ids=taps, eos_ids=eos), HistoryProposer(ngram, 3), prompts, 64)   # for real

Why: a drafter near their τ is broken. They propose from the tokens alone, so their τ is replayed
exactly on the greedy output (``replay``; evaluate's is the chain's, equal to plain greedy decoding's
under greedy verification) instead of decoded again; ``HistoryProposer`` decodes
them for real, which gives the same acceptances (tests/test_speculative.py).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from eagle3.decoding.batch import Batch
from eagle3.decoding.tree import Draft, Round
from eagle3.decoding.acceptance import acceptance_stats, tau_by_position


def most_frequent(token: int) -> Callable[[list[int], int], list[int]]:
    """The context-free baseline: always ``k`` times the same token."""
    return lambda history, k: [token] * k


def ngram(history: list[int], k: int, max_n: int = 3) -> list[int]:
    """Prompt lookup (vLLM's and SGLang's ``ngram``): what followed the latest earlier match of the last n tokens.

    n from ``max_n`` down to 1, the longest matching suffix first, its most recent earlier occurrence;
    up to ``k`` tokens, none without a match. Example: history [5, 6, 7, 1, 5, 6], k = 2 -> [7, 1].

    The search runs over the history's bytes (4 a token; ``bytes.rfind``), a hit inside a token skipped: a Python
    scan of every earlier position took evaluate seconds a set at 256-token answers.
    """
    data = array("I", history).tobytes()
    for n in range(min(max_n, len(history) - 1), 0, -1):
        suffix = data[-4 * n :]
        end = len(data) - 4  # the match ends before the last token: the suffix itself is no earlier occurrence
        while (at := data.rfind(suffix, 0, end)) >= 0:
            if at % 4 == 0:
                start = at // 4 + n
                return history[start : start + k]
            end = at + 4 * n - 1  # the next hit starts before this one
    return []


class HistoryProposer:
    """A chain of up to K drafts from each row's tokens so far (prompt + output), e.g. ``ngram``."""

    def __init__(self, propose: Callable[[list[int], int], list[int]], k: int):
        self.propose_fn, self.k = propose, k

    def start(self, prompts: Sequence[Tensor], batch: Batch, features: Tensor) -> None:
        self.histories = [p.tolist() + [int(r)] for p, r in zip(prompts, batch.root)]
        self.device = batch.root.device

    def advance(self, round_: Round) -> None:
        for history, emitted in zip(self.histories, round_.emitted):
            history += emitted

    def keep_rows(self, rows: Tensor) -> None:
        self.histories = [self.histories[r] for r in rows.tolist()]

    def propose(self) -> Draft:
        proposals = [self.propose_fn(h, self.k)[: self.k] for h in self.histories]
        tokens = torch.tensor([p + [0] * (self.k - len(p)) for p in proposals], device=self.device)  # [B, K]
        valid = torch.arange(self.k, device=self.device) < torch.tensor([len(p) for p in proposals], device=self.device)[:, None]
        parents = torch.arange(self.k, device=self.device).expand_as(tokens)  # a chain
        return Draft(tokens, parents, valid)


def replay(propose: Callable[[list[int], int], list[int]], prompt: list[int], output: list[int], k: int) -> list[tuple[int, bool]]:
    """Per verifier forward, the drafts accepted and whether any were proposed, had a history proposer decoded
    ``output`` (the plain greedy output); prompt lookup proposes nothing where it finds no match.

    Exact without running the verifier: under greedy verification every forward's greedy tokens are
    the output's, and decoding stops accepting at the output's end (its budget or EOS), as
    ``accept`` does. Example: output [4, 5, 6, 7], drafts always [5, 6]: forward 1 at [4] accepts
    5, 6 (then bonus 7): [(2, True)].
    """
    rounds, done = [], 1  # prefill emits output[0]
    while done < len(output):
        drafts = propose(prompt + output[:done], k)[:k]
        j = 0
        while j < len(drafts) and done + j < len(output) - 1 and drafts[j] == output[done + j]:
            j += 1
        rounds.append((j, bool(drafts)))
        done += j + 1
    return rounds


def most_frequent_token(outputs: Sequence[list[int]]) -> int:
    """The most frequent generated token (ties: the lower id)."""
    counts = Counter(token for tokens in outputs for token in tokens)
    return min(counts, key=lambda token: (-counts[token], token))


def baselines(prompts: Sequence[torch.Tensor], outputs: Sequence[list[int]], k: int, edges: Sequence[int] = (),
              token: int | None = None) -> dict:
    """The most-frequent-token and n-gram baselines, replayed on the greedy outputs (one per prompt).

    Both ``tau`` are per sequence, over every verifier forward (comparable with the drafter's τ), and
    ``tau_by_position`` per bucket of ``edges`` (``acceptance.tau_by_position``). Prompt lookup
    proposes nothing where it finds no match, so it also has ``tau_matched_rounds`` (τ over the
    forwards it drafted for) and ``matched_rounds`` (their share): e.g. 10 forwards, 4 with a match
    accepting 2 each -> tau 1.8, tau_matched_rounds 3.0, matched_rounds 0.4. ``token``: the
    most frequent token to propose (default: the outputs' own).
    """
    token = most_frequent_token(outputs) if token is None else token
    report, rounds = {}, {}
    for name, propose in (("baseline", most_frequent(token)), ("ngram", ngram)):
        rounds[name] = [replay(propose, ids.tolist(), out, k) for ids, out in zip(prompts, outputs)]
        accepted = [[j for j, _ in answer] for answer in rounds[name]]
        report[name] = {**acceptance_stats([j for answer in accepted for j in answer], k),
                        "tau_by_position": tau_by_position(accepted, edges)}
    report["baseline"]["token"] = token
    matched = [j for answer in rounds["ngram"] for j, drafted in answer if drafted]
    report["ngram"]["tau_matched_rounds"] = acceptance_stats(matched, k)["tau"]
    report["ngram"]["matched_rounds"] = len(matched) / max(1, report["ngram"]["forwards"])
    return report
