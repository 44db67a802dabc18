"""How slot decoding (``slots``) groups its requests: by prompt width, each group over one cache of
as many rows as the batch limits allow, and what one cache position costs.

    groups = group_requests(requests, max_new_tokens, batch_size, batch_tokens)
    cache_bytes_per_position(model)      # the local backend sizes batch_tokens from the free GPU memory
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3.backends.base import Request
from eagle3.backends.padding import padded_width
from eagle3.lm.spec import attention_shape

MIN_WIDTH = 256  # narrowest prompt-width bucket: groups by width 256, 512, 1024, ...
WIDTH_MULTIPLE = 64  # a group's cache length: its widest prompt rounded up to this, + max_new_tokens


@dataclass(frozen=True)
class Group:
    """Requests decoded over one cache of ``slots`` rows x ``length`` positions."""

    requests: list[Request]  # sorted by prompt length
    slots: int
    length: int  # widest prompt (rounded up to WIDTH_MULTIPLE) + max_new_tokens


def width_bucket(length: int) -> int:
    """The power of two (at least MIN_WIDTH) a prompt of ``length`` tokens is grouped under: 90 -> 256, 300 -> 512."""
    return max(MIN_WIDTH, 1 << (length - 1).bit_length())


def group_requests(requests: Sequence[Request], max_new_tokens: int, batch_size: int, batch_tokens: int | None) -> list[Group]:
    """Requests sorted by (prompt length, id), cut into groups by ``width_bucket``; a group smaller than
    its slot count joins the next one (each group ends with a drain: fewer groups, fewer drains).

    Slots: ``batch_size`` rows, fewer when rows x length would exceed ``batch_tokens``, never more
    than the group's requests. Example: lengths [10, 20, 300], max_new_tokens 100, batch_size 2 ->
    one group of the 2 short prompts (256 bucket, length 64 + 100) and one of [300] (length 320 + 100).
    """
    ordered = sorted(requests, key=lambda r: (len(r.prompt_ids), r.id))
    buckets: dict[int, list[Request]] = {}
    for request in ordered:
        buckets.setdefault(width_bucket(len(request.prompt_ids)), []).append(request)
    groups, carried = [], []
    for index, bucket in enumerate(buckets.values()):
        carried += bucket
        length = padded_width(len(carried[-1].prompt_ids), WIDTH_MULTIPLE) + max_new_tokens
        slots = min(batch_size, max(1, batch_tokens // length) if batch_tokens else batch_size)
        if len(carried) >= slots or index == len(buckets) - 1:
            groups.append(Group(carried, min(slots, len(carried)), length))
            carried = []
    return groups


def cache_bytes_per_position(model) -> int:
    """Bytes of the slot cache a row position takes: keys and values of every layer (SmolLM2-135M in bf16:
    2 x 30 layers x 3 kv heads x 64 x 2 bytes = 23,040; Llama-3.1-8B: 131,072)."""
    config = model.config.get_text_config()
    _, kv_heads, head_dim = attention_shape(config)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
