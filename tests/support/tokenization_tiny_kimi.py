"""A remote-code tokenizer shaped like Kimi-K2.5's: a slow ``PreTrainedTokenizer`` around a byte-level BPE core.

Kimi-K2.5 ships ``tokenization_kimi.py`` (a tiktoken core behind transformers' Python tokenizer
interface, loaded with ``trust_remote_code``), which has no offset mapping. This file plays that
part for the tiny Kimi-shaped test verifier: ``tests/support/tiny_kimi.py`` registers it for
``AutoTokenizer``, so ``save_pretrained`` copies it next to ``tokenizer_config.json`` with an
``auto_map`` entry, and the pipeline must load it as remote code. Its core is SmolLM2's BPE.
"""

from __future__ import annotations

import os
import shutil

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizer


class TinyKimiTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "bpe.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        self.vocab_file = vocab_file
        self.core = Tokenizer.from_file(vocab_file)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.core.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return {**self.core.get_vocab(with_added_tokens=False), **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return self.core.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token: str) -> int:
        return self.core.token_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.core.id_to_token(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.core.decoder.decode(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (filename_prefix or "") + self.vocab_files_names["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            shutil.copyfile(self.vocab_file, target)
        return (target,)
