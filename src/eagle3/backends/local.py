"""The ``local`` backend: the verifier answers in-process with transformers ``generate``.

Batches are cut from the requests sorted by prompt length (least padding): at most
``batch_size`` rows and, with ``batch_tokens``, at most that many tokens of KV cache per batch
(rows x (padded prompt + max_new_tokens)), so short prompts go in big batches and long ones in
small ones. Each batch is left padded to a multiple of ``pad_multiple`` tokens (fewer distinct
shapes). Greedy decoding, or sampling where every row draws by its record's own seed
(``backends.sampling``), so a record's answer never depends on which records share its batch. With several
answers per prompt (``generate.samples``), each answer index is batched on its own: a batch has
one temperature, and answer 0's batches (and padding, which a row's numerics depend on) are
exactly those of a ``samples: 1`` run.

On CUDA, cuDNN's SDPA attention is switched off: it pays a setup for every new (batch, length)
shape, about 10 s per 256 prompts on an H200, which dominated a shard; the flash and
memory-efficient SDPA kernels have no such cost.

On CUDA with ``cuda_graphs``, ``backends.slots`` answers instead, greedy and sampled: a slot KV
cache refilled as rows finish, each decode step a CUDA graph (eager decoding is host-bound there) whose
attention reads each row's used keys only; groups by prompt width replace the batches above, with as
many rows as ``batch_size`` and ``cache_memory`` (a share of the GPU memory free after loading the
verifier) allow: ``batch_tokens`` bounds the eager batches only. The CPU keeps ``generate``, as does
every group from the first whose attention slots cannot hold (softcapping, sinks, a sliding window
shorter than the group's cache: Gemma-2, gpt-oss, Mistral), with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from eagle3.backends.base import Answer, Done, Generation, Request, cut_at_stop, split_reasoning
from eagle3.backends.padding import left_pad, padded_width
from eagle3.backends.sampling import Sampling
from eagle3.backends.slot_groups import cache_bytes_per_position, group_requests
from eagle3.backends.slots import Ending, SlotsCannotAttend, decode_groups
from eagle3.common import UserError
from eagle3.lm.loading import eos_token_ids, load_tokenizer, load_verifier, prepare_torch

log = logging.getLogger(__name__)


def plan_batches(
    requests: Sequence[Request], batch_size: int, batch_tokens: int | None = None, max_new_tokens: int = 0,
    pad_multiple: int = 1,
) -> list[list[Request]]:
    """Requests sorted by (prompt length, id), cut into batches: fixed for a given shard.

    A batch closes at ``batch_size`` rows, or before the row that would make rows x (padded
    width + max_new_tokens) exceed ``batch_tokens`` (the width is the newest row's: ascending).
    Example: lengths [10, 20, 300], batch_tokens 1000, max_new_tokens 100, pad_multiple 1 ->
    [[10, 20], [300]] (a third row would need 3 x 400 = 1200 tokens).
    """
    ordered = sorted(requests, key=lambda r: (len(r.prompt_ids), r.id))
    batches: list[list[Request]] = []
    for request in ordered:
        rows = len(batches[-1]) + 1 if batches else 0
        tokens = rows * (padded_width(len(request.prompt_ids), pad_multiple) + max_new_tokens)
        if not batches or rows > batch_size or (batch_tokens and rows > 1 and tokens > batch_tokens):
            batches.append([])
        batches[-1].append(request)
    return batches


def by_sample(requests: Sequence[Request]) -> list[list[Request]]:
    """The requests split by answer index, in index order: one temperature each, and answer 0's part is
    what a ``samples: 1`` run gets, so its batches are the same."""
    parts: dict[int, list[Request]] = {}
    for request in requests:
        parts.setdefault(request.sample, []).append(request)
    return [parts[sample] for sample in sorted(parts)]


class SeededSampling(LogitsProcessor):
    """``Sampling``'s draw inside transformers ``generate``: the scores it returns are -inf everywhere but the drawn
    token, so greedy decoding (``do_sample=False``) takes it; the draw's index is the tokens generated so far."""

    def __init__(self, seeds: torch.Tensor, sampling: Sampling, prompt_width: int):  # seeds [B] on the scores' device
        self.seeds, self.sampling, self.prompt_width = seeds, sampling, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # input_ids [B, T], scores [B, V]
        index = torch.full((len(scores),), input_ids.shape[1] - self.prompt_width, device=scores.device)
        picks = self.sampling(scores, self.seeds, index)  # [B]
        return torch.full_like(scores, float("-inf")).scatter_(-1, picks[:, None], 0.0)


class LocalBackend:
    decode_kernel: str | None = None  # slot decoding's attention (slot_kernels.KERNELS); None: the fastest that runs here

    def __init__(self, cfg: DictConfig, verifier: Path, generation: Generation):
        prepare_torch(str(cfg.device), int(cfg.threads))  # cuDNN's SDPA off on CUDA (the module docstring)
        trust = generation.trust_remote_code
        self.model = load_verifier(verifier, str(cfg.device), str(cfg.dtype), trust)
        self.tokenizer = load_tokenizer(verifier, trust)
        self.batch_size = int(cfg.batch_size)
        self.batch_tokens = int(cfg.batch_tokens) if cfg.get("batch_tokens") else None
        self.pad_multiple = int(cfg.get("pad_multiple") or 1)
        self.cache_memory = float(cfg.cache_memory)
        self.generation = generation
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.stop_strings = list(generation.stop)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        graphs = bool(cfg.cuda_graphs) and str(cfg.device).startswith("cuda")
        self.slot_decoding = graphs and self.model._supports_attention_backend
        if graphs and not self.slot_decoding:
            log.warning("local backend: decoding eagerly where CUDA graphs cannot (they need a verifier that attends "
                        "through transformers' AttentionInterface)")
        self.graph_replays = 0  # CUDA graph steps run by slot decoding (benchmarks and tests read it)

    def run(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None:
        for part in by_sample(requests):
            answered = set(finished)
            if self.slot_decoding:
                try:
                    self.run_slots([r for r in part if r.id not in answered], lambda r, a: (answered.add(r.id), done(r, a)))
                    continue
                except SlotsCannotAttend as reason:  # at a group's first forward: a narrower group may have answered
                    log.warning("local backend: decoding the rest eagerly: %s", reason)
                    self.slot_decoding = False
            self.run_batches(part, answered, done)  # what a resumed run would do with those answers journaled

    def run_batches(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None:
        """Answers by transformers ``generate``, a batch at a time (a batch with an unfinished row is re-run whole)."""
        max_new_tokens = self.generation.max_new_tokens
        for batch in plan_batches(requests, self.batch_size, self.batch_tokens, max_new_tokens, self.pad_multiple):
            if all(r.id in finished for r in batch):
                continue
            for request, answer in zip(batch, self.answer_batch(batch)):
                done(request, answer)

    @torch.inference_mode()
    def run_slots(self, requests: Sequence[Request], done: Done) -> None:
        """Answers by ``backends.slots`` (one answer index: one temperature): a row's answer comes as soon as it finishes."""
        if not requests:
            return
        max_new_tokens = self.generation.max_new_tokens
        groups = group_requests(requests, max_new_tokens, self.batch_size, self.slot_cache_tokens())
        try:
            self.graph_replays += decode_groups(self.model, groups, Ending(max_new_tokens, sorted(self.eos_ids), self.pad_id),
                                                lambda request, tokens: done(request, self.to_answer(request, tokens)),
                                                self.decode_kernel, self.sampling(requests))
        except torch.cuda.OutOfMemoryError as error:
            raise UserError(f"backend.cache_memory: a slot cache of {self.cache_memory:.0%} of the free GPU memory did not fit "
                            f"({error}); lower it (generate processes sharing a GPU split it between them)") from None

    def sampling(self, requests: Sequence[Request]) -> Sampling:
        """How ``requests`` draw their tokens: ``run`` hands over one answer index at a time, one temperature."""
        return Sampling(requests[0].temperature, self.generation.top_p)

    def slot_cache_tokens(self) -> int | None:
        """KV-cache positions slot decoding may hold: ``backend.cache_memory`` of the GPU memory free now over the
        verifier's cache bytes a position (rows as big as memory allows); off CUDA, backend.batch_tokens."""
        if self.model.device.type != "cuda":
            return self.batch_tokens
        free, _ = torch.cuda.mem_get_info(self.model.device)
        return int(self.cache_memory * free) // cache_bytes_per_position(self.model)

    @torch.inference_mode()
    def answer_batch(self, batch: Sequence[Request]) -> list[Answer]:
        gen = self.generation
        input_ids, attention_mask = left_pad([r.prompt_ids for r in batch], self.pad_id, self.pad_multiple)  # [B, T]
        config = GenerationConfig(
            max_new_tokens=gen.max_new_tokens, do_sample=False,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id, stop_strings=self.stop_strings or None,
        )
        processors = LogitsProcessorList()
        sampling, device = self.sampling(batch), self.model.device
        if sampling.temperature > 0:
            seeds = torch.tensor([r.seed for r in batch], device=device)
            processors.append(SeededSampling(seeds, sampling, input_ids.shape[1]))
        output = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            generation_config=config, logits_processor=processors, tokenizer=self.tokenizer,  # (stop strings need it)
        )
        new_tokens = output[:, input_ids.shape[1] :].tolist()  # [B, <= max_new_tokens]
        return [self.to_answer(r, tokens) for r, tokens in zip(batch, new_tokens)]

    def to_answer(self, request: Request, tokens: list[int]) -> Answer:
        """Cut a generated row at its first stop token or stop string (counted, not in the text)."""
        stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
        kept = tokens if stop is None else tokens[: stop + 1]
        text = self.tokenizer.decode(kept if stop is None else kept[:-1], skip_special_tokens=False)
        text, matched = cut_at_stop(text, self.stop_strings)
        if matched is not None:
            kept = self.tokens_through(kept, len(text) + len(matched))
        reasoning, content = split_reasoning(text, self.generation.think_tags)
        return Answer(
            content=content, reasoning_content=reasoning,
            finish_reason="length" if stop is None and matched is None else "stop",
            prompt_tokens=len(request.prompt_ids), completion_tokens=len(kept), stop=matched,
        )

    def tokens_through(self, tokens: list[int], chars: int) -> list[int]:
        """The shortest prefix of ``tokens`` whose text is ``chars`` long or longer: the answer up to its
        stop string (generation halts on the token completing it; a batch pads finished rows after it)."""
        n = len(tokens)
        while n > 1 and len(self.tokenizer.decode(tokens[: n - 1], skip_special_tokens=False)) >= chars:
            n -= 1
        return tokens[:n]
