"""How a conversation becomes the verifier's tokens, and which of them the drafter learns: one place
for every stage that renders a chat (prompts and generate: the prompt; extract: the whole
conversation and its loss mask).

    ids = prompt_ids(tokenizer, messages)                                  # prompt + generation prompt
    fmt = spec.chat.for_tokenizer(tokenizer)                               # VerifierSpec: model.chat_*
    input_ids, loss_mask = render(tokenizer, [*prompt, answer], fmt)       # loss_mask 1 on the answer

The rules are the verifier family's (``conf/model``: ``chat_template``, ``reasoning_format``,
``end_of_turn``); docs/design.md §1 says what the drafter does with the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from eagle3.common import UserError


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat under the verifier's template, with the generation prompt appended."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class RenderError(ValueError):
    """A conversation the chat template cannot turn into an answer span; the record is rejected."""


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes tokens and which tokens are the answer (params ``model``, through the spec)."""

    chat_template: str | None  # Jinja template; None: the tokenizer's own
    reasoning_format: str  # "template": the template renders reasoning_content; else a prefix with {reasoning}
    end_of_turn: str | None  # the marker closing the answer (masked: the drafter must predict it); None: the eos token

    def for_tokenizer(self, tokenizer) -> ChatFormat:
        """This format with the end of turn resolved: the tokenizer's eos token when none is configured."""
        return replace(self, end_of_turn=self.end_of_turn or tokenizer.eos_token)


def with_reasoning(answer: dict, fmt: ChatFormat) -> dict:
    """The answer message as the template must see it: reasoning prefixed unless the template renders it."""
    reasoning = answer.get("reasoning_content")
    if not reasoning or fmt.reasoning_format == "template":
        return answer
    return {"role": answer["role"], "content": fmt.reasoning_format.replace("{reasoning}", reasoning) + answer["content"]}


def apply_template(tokenizer, messages: list[dict], fmt: ChatFormat, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, chat_template=fmt.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def render(tokenizer, messages: list[dict], fmt: ChatFormat, finished: bool = True,
           stop: str | None = None) -> tuple[list[int], list[int]]:
    """``input_ids`` and ``loss_mask`` of a conversation whose last message is the generated answer.

    The answer span is found by rendering twice: the prompt with the generation prompt (the span
    starts where that text ends) and the whole conversation (the span ends with the first
    end-of-turn marker after the answer's content: ``stop``, the model.stop string that ended
    the answer, else ``fmt.end_of_turn``). Tokens overlapping the span, by character
    offsets, are masked. Only the last (generated) turn is masked; earlier assistant turns of a
    prompt were not written by the verifier. An answer cut by the token limit (``finished``
    False) never produced the end-of-turn token: the span then ends with the content. ChatML:

        ...<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello!<|im_end|>\\n
        mask:  0         0  0    0       0      0          0     0  1      1       0
    """
    *prompt, answer = messages
    answer = with_reasoning(answer, fmt)
    head = apply_template(tokenizer, prompt, fmt, add_generation_prompt=True)
    text = apply_template(tokenizer, [*prompt, answer], fmt, add_generation_prompt=False)
    if not text.startswith(head):
        raise RenderError("the chat template renders the prompt differently once the answer is added")
    reasoning = answer.get("reasoning_content")
    if reasoning and reasoning.strip() not in text[len(head):]:
        raise UserError(
            "model.reasoning_format is 'template' but the chat template drops reasoning_content; "
            "set a prefix such as '<think>\\n{reasoning}\\n</think>\\n' in conf/model"
        )
    content = answer["content"].strip()  # templates may trim the content
    content_at = text.find(content, len(head))
    if content_at < 0:
        raise RenderError("the answer's content does not appear in the rendered conversation")
    marker = stop or fmt.end_of_turn
    marker_at = text.find(marker, content_at + len(content))
    if marker_at < 0:
        raise RenderError(f"no end-of-turn marker {marker!r} after the answer")
    start, end = len(head), marker_at + len(marker) if finished else content_at + len(content)
    if not tokenizer.is_fast:
        return encode_pieces(tokenizer, text, start, end)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(stop > start and first < end) for first, stop in encoding["offset_mapping"]]
    return list(encoding["input_ids"]), mask


def text_after_answer(tokenizer) -> str:
    """What the tokenizer's chat template writes after an answer: ``render`` ends the answer's span
    with the first end-of-turn marker found there, so every configured marker must appear in it.

    Example (ChatML): ``"<|im_end|>\\n"``.
    """
    answer = "Hello there."
    probe = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": answer}]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    return text[text.find(answer) + len(answer):] if answer in text else ""


def encode_pieces(tokenizer, text: str, start: int, end: int) -> tuple[list[int], list[int]]:
    """``render``'s ids and mask for a tokenizer without offsets (Kimi-K2.5's tiktoken one is pure Python).

    The text before, inside and after the span ``[start, end)`` is tokenized separately; this is
    exact when both edges are special tokens (``<think>``/``<|im_middle|>`` ends the generation
    prompt, ``<|im_end|>`` closes the answer), which is checked against the whole text's ids.
    """
    pieces = [tokenizer(part, add_special_tokens=False)["input_ids"] for part in (text[:start], text[start:end], text[end:])]
    ids = [token for piece in pieces for token in piece]
    if ids != list(tokenizer(text, add_special_tokens=False)["input_ids"]):
        raise RenderError("the answer's edges are not token boundaries, and this tokenizer has no offsets to find them")
    return ids, [0] * len(pieces[0]) + [1] * len(pieces[1]) + [0] * len(pieces[2])
