"""The ``extract`` params section's schema: how the verifier's hidden states are captured and stored.

    check_schema(ExtractSettings, get)    # config.validate, for every view holding extract keys
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3.schema import POSITIVE, one_of, setting

STORAGE_DTYPES = ("bfloat16", "float8_e4m3fn")  # how a part stores the states (``storage.encode_states``)


@dataclass(frozen=True)
class ExtractSettings:
    """One field per key of conf/extract/*.yaml (read by ``capture.Settings.from_params``)."""

    GROUP: ClassVar[str] = "extract"

    max_length: int = setting(POSITIVE)  # tokens per sequence; longer ones are truncated and counted
    dtype: str = setting(one_of(*STORAGE_DTYPES))  # storage dtype (fp8: per-token, per-layer scale)
    batch_tokens: int = setting(POSITIVE)  # padded tokens per verifier forward
    part_bytes: int = setting(POSITIVE)  # target size of one safetensors part
