"""Generated records rendered into samples: the tokens the verifier reads and the answer mask the
drafter learns on, each bad record rejected with its reason (``eagle3.lm.chat.render``).

``loss_mask[t] = 1`` iff token t belongs to the generated answer (reasoning and the end-of-turn token
included, unless the answer was cut at the token limit; template scaffolding excluded); unshifted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from eagle3.common import UserError
from eagle3.lm.chat import ChatFormat, RenderError, render

MAX_REJECTED_SHARE = 0.10  # a shard rejecting more of its records is refused: a broken rule, not a few bad records


@dataclass
class Sample:
    """A rendered conversation: what the verifier reads and which tokens the drafter learns."""

    id: str
    record: int  # 0-based position in records.jsonl
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool


def record_problem(record: dict) -> str | None:
    """Why a generated record is not a conversation ending with an answer, or None."""
    messages = record.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return "record: messages must be a list of at least a prompt and an answer"
    answer = messages[-1]
    if not isinstance(answer, dict) or answer.get("role") != "assistant" or not isinstance(answer.get("content"), str):
        return "record: the last message must be an assistant answer with string content"
    return None


def prepare(records: list[dict], tokenizer, fmt: ChatFormat, max_length: int) -> tuple[list[Sample], list[dict]]:
    """Render every record; returns the samples and the rejections (id, record, reason)."""
    samples, rejected = [], []
    for number, record in enumerate(tqdm(records, desc="render", unit="rec")):
        problem = record_problem(record)
        if problem is None:
            try:
                ids, mask = render(tokenizer, record["messages"], fmt, record.get("finish_reason") != "length", record.get("stop"))
            except RenderError as err:
                problem = f"render: {err}"
        if problem is None:
            truncated = len(ids) > max_length
            ids, mask = ids[:max_length], mask[:max_length]
            problem = mask_problem(mask, truncated)
        if problem is None:
            samples.append(Sample(str(record.get("id")), number, ids, mask, truncated))
        else:
            rejected.append({"id": record.get("id"), "record": number, "reason": problem})
    return samples, rejected


def check_rejections(generated: Path, rejected: list[dict], records: int) -> None:
    """Refuse a shard that rejects more than MAX_REJECTED_SHARE of its records, in one line with the
    reason counts: a rule the configuration breaks (e.g. a chat template that does not write the
    stop string) must not silently cost half the data."""
    if len(rejected) > MAX_REJECTED_SHARE * records:
        reasons = dict(Counter(r["reason"] for r in rejected).most_common())
        raise UserError(f"{generated}/records.jsonl: {len(rejected)} of {records} records rejected, more than "
                        f"{MAX_REJECTED_SHARE:.0%} ({reasons}); fix the cause (model.stop, model.end_of_turn and the chat "
                        "template, or extract.max_length) and re-run extract")


def mask_problem(mask: list[int], truncated: bool) -> str | None:
    if not any(mask):
        return "loss_mask is all zero" + (" after truncation to extract.max_length" if truncated else "")
    if all(mask):
        return "loss_mask is all one (no prompt tokens)"
    return None
