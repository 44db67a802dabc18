"""The ``local`` backend: the verifier answers in-process with transformers ``generate``.

Batches are cut from the requests sorted by prompt length (least padding) and left padded.
Greedy decoding, or sampling where every row draws from its own generator seeded from its
record id, so a record's answer never depends on which records share its batch.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from eagle3.backends import Answer, Done, Request, cut_at_stop, split_reasoning
from eagle3.verifier import eos_token_ids, load_tokenizer, load_verifier

log = logging.getLogger(__name__)


def plan_batches(requests: Sequence[Request], batch_size: int) -> list[list[Request]]:
    """Requests sorted by (prompt length, id), cut into batches: fixed for a given shard."""
    ordered = sorted(requests, key=lambda r: (len(r.prompt_ids), r.id))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> (input_ids [B, T], attention_mask [B, T]), padded on the left."""
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = torch.tensor(row)
        attention_mask[b, width - len(row) :] = 1
    return input_ids, attention_mask


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of each row of ``probs`` [B, V] beyond the smallest set holding ``top_p`` mass."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # mass before a token already >= top_p
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


class SeededSampling(LogitsProcessor):
    """Sample row b with its own generator seeded ``seeds[b]``; greedy decoding then picks the draw.

    The returned scores are -inf everywhere except the sampled token, so ``do_sample=False``
    keeps each row's tokens independent of the other rows (one global RNG would not).
    """

    def __init__(self, seeds: Sequence[int], temperature: float, top_p: float):
        self.seeds, self.temperature, self.top_p = seeds, temperature, top_p
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # scores [B, V]
        if self.generators is None:
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        probs = top_p_filter(torch.softmax(scores.float() / self.temperature, dim=-1), self.top_p)
        picks = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])  # [B]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(picks)), picks] = 0.0
        return out


class LocalBackend:
    def __init__(self, cfg: DictConfig, verifier: Path, generate: DictConfig):
        torch.set_num_threads(int(cfg.threads))
        trust = bool(generate.trust_remote_code)
        self.model = load_verifier(verifier, str(cfg.device), str(cfg.dtype), trust)
        self.tokenizer = load_tokenizer(verifier, trust)
        self.batch_size = int(cfg.batch_size)
        self.generate_cfg = generate
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.stop_strings = [str(stop) for stop in generate.get("stop") or []]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

    def run(self, requests: Sequence[Request], finished: Collection[str], done: Done) -> None:
        for batch in plan_batches(requests, self.batch_size):
            if all(r.id in finished for r in batch):
                continue
            for request, answer in zip(batch, self.answer_batch(batch)):
                done(request, answer)

    @torch.inference_mode()
    def answer_batch(self, batch: Sequence[Request]) -> list[Answer]:
        gen = self.generate_cfg
        input_ids, attention_mask = left_pad([r.prompt_ids for r in batch], self.pad_id)  # [B, T]
        config = GenerationConfig(
            max_new_tokens=int(gen.max_new_tokens), do_sample=False,
            eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id, stop_strings=self.stop_strings or None,
        )
        processors = LogitsProcessorList()
        if float(gen.temperature) > 0:
            processors.append(SeededSampling([r.seed for r in batch], float(gen.temperature), float(gen.top_p)))
        device = self.model.device
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
        reasoning, content = split_reasoning(text, self.generate_cfg.think_tags)
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
