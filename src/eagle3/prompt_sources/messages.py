"""A record as chat messages (OpenAI-style, ShareGPT or a plain prompt), and the keys that identify
a prompt for deduplication, held-out membership and eval-set overlap (case and whitespace aside).
"""

from __future__ import annotations

from eagle3.common import stable_hash

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}


def to_messages(record: dict, field: str = "messages") -> list[dict] | None:
    """Normalise a raw record to chat messages ending with a user turn; None if it has no usable prompt.

    Accepts OpenAI-style message lists (``input`` of evals, ``messages``), ShareGPT
    ``conversations`` ({from, value}) and plain strings (``prompt``); trailing assistant turns
    are dropped because the verifier writes its own answer.
    """
    raw = next((record[k] for k in (field, "input", "messages", "conversations", "prompt") if k in record), None)
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        return None
    messages = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        role = SHAREGPT_ROLES.get(turn.get("role") or turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLES or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content.strip()})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages if messages and messages[-1]["role"] == "user" else None


def text_key(text: str) -> str:
    """The identity of a prompt text for overlap checks: case and whitespace do not count."""
    return stable_hash(" ".join(text.split()).casefold())


def user_keys(messages: list[dict]) -> set[str]:
    return {text_key(m["content"]) for m in messages if m["role"] == "user"}


def conversation_key(messages: list[dict]) -> str:
    """The identity of a whole prompt for dedup and held-out membership: every turn's role and
    normalised text, system included. Keying on the last user turn alone collapsed families whose
    prompts end in one shared instruction (raven-matrices: 56,000 puzzles to 2 prompts)."""
    return stable_hash([(m["role"], " ".join(m["content"].split()).casefold()) for m in messages])
