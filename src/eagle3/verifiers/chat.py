"""How a conversation becomes the verifier's tokens: its chat template, in one place for every stage."""

from __future__ import annotations


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat under the verifier's template, with the generation prompt appended."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
