"""A record as chat messages (OpenAI-style, ShareGPT or a plain prompt), and the keys that identify
a prompt for deduplication, held-out membership and eval-set overlap (case and whitespace aside).
"""

from __future__ import annotations

from eagle3.common import stable_hash

ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}  # ShareGPT's other assistants
TURN_LISTS = ("messages", "input", "conversations")  # where a record's turns are, first found wins
STRING_PROMPTS = ("input", "prompt")  # fields that may hold a single user prompt as a string (evals' `input`)


class NotAPrompt(ValueError):
    """Why a record is no chat prompt: ``reason`` counts it among the drops; the message says what to do."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def to_messages(record: dict) -> list[dict]:
    """A raw record as chat messages ending with a user turn; else ``NotAPrompt``.

    Accepts OpenAI-style message lists (``input`` of evals, ``messages``), ShareGPT
    ``conversations`` ({from, value}) and plain strings (``prompt``, evals' ``input``). Nothing is
    trimmed or coerced: a record ending with an answer, or a turn list given as a string, is refused,
    so every prompt the verifier answers is the one the file holds.
    """
    field = next((k for k in (*TURN_LISTS, "prompt") if k in record), None)
    if field is None:
        raise NotAPrompt("not_a_chat_prompt", "no 'messages', 'conversations' or 'prompt' field; give a 'messages' "
                                              "list of {role, content} turns ending with a user turn, or a 'prompt' string")
    raw = record[field]
    if isinstance(raw, str) and field in STRING_PROMPTS:
        raw = [{"role": "user", "content": raw}]
    elif isinstance(raw, str):
        raise NotAPrompt("turns_as_a_string", f"'{field}' is a string, not a list of turns; give "
                                              f"[{{\"role\": \"user\", \"content\": ...}}], or a 'prompt' string")
    messages = turn_messages(raw, field)
    if messages[-1]["role"] == "assistant":
        raise NotAPrompt("ends_with_assistant_turn", f"'{field}' ends with an assistant turn; end it with the user turn "
                                                     "to answer (the verifier writes its own answer), or read whole "
                                                     "conversations with `kind: sharegpt` (a prompt per user turn)")
    if messages[-1]["role"] != "user":
        raise NotAPrompt("not_a_chat_prompt", f"'{field}' does not end with a user turn")
    return messages


def turn_messages(raw, field: str) -> list[dict]:
    """A list of {role, content} / {from, value} turns as messages, each stripped; else ``NotAPrompt``."""
    if not isinstance(raw, list) or not raw:
        raise NotAPrompt("not_a_chat_prompt", f"'{field}' is not a non-empty list of turns")
    messages = []
    for number, turn in enumerate(raw, start=1):
        if not isinstance(turn, dict):
            raise NotAPrompt("not_a_chat_prompt", f"'{field}' turn {number} is not a {{role, content}} object")
        role = SHAREGPT_ROLES.get(turn.get("role") or turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in ROLES or not isinstance(content, str) or not content.strip():
            raise NotAPrompt("not_a_chat_prompt", f"'{field}' turn {number} needs a role (system, user, assistant) "
                                                  "and non-empty text content")
        if not content.isascii() and not encodable(content):
            raise NotAPrompt("not_valid_unicode", f"'{field}' turn {number} holds a lone surrogate (e.g. \\ud800), "
                                                  "which no UTF-8 file can store; fix or remove the text")
        messages.append({"role": role, "content": content.strip()})
    return messages


def encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
