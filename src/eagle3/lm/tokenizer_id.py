"""The id of what a verifier folder's prompts depend on: how its tokenizer splits text, and its chat template.

    tokenizer_fingerprint("models/verifier")   # the prompts stage records it, evaluate checks it

Prompts composed on one machine stay valid for the same tokenizer imported on another, though
another transformers version writes it in other bytes. Measured on SmolLM2's GGUF, 5.17 against
5.24: tokenizer_config.json gains add_prefix_space, legacy, model_type and *_token_id keys and
names another eos_token (no pad_token); tokenizer.json writes an empty normaliser Sequence for
none, another decoder, other byte_fallback/fuse_unk/unk_token and pre-tokeniser trim_offsets; the
merges may be "a b" strings or ["a", "b"] pairs. Every prompt's token ids are the same. So the id
is made only of what decides them (``chat.prompt_ids``: render the template, then encode without
special tokens):

- the default chat template's text (chat_template.jinja, else tokenizer_config.json's);
- the special tokens by role (bos_token ...) that the template can print, the ones it names;
- with tokenizer.json: the vocabulary, the merges as pairs, every added token (content, id,
  whether special), and the ids of a fixed probe text (with every added token in it) as the
  ``tokenizers`` library encodes it, which is how the normaliser, pre-tokeniser, byte fallback and
  the added tokens' strip flags act, whatever way the file spells them. The decoder and the
  post-processor never touch a prompt's ids;
- without one (sentencepiece or remote-code tokenizers) no parse says how text splits: every
  tokenizer file counts, JSON by content, tokenizer_config.json without its records of where and
  by what it was written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.common import UserError, read_json, sha256_file, stable_hash
from eagle3.lm.loading import WEIGHT_SUFFIXES

# Files of a verifier folder that describe the model, not its tokenizer: config.json and
# generation_config.json carry transformers_version and the weights' dtype, which change when the same
# GGUF is imported under another torch/transformers, while every token and template stays the same.
MODEL_FILES = {"config.json", "generation_config.json", "meta.json", "model.safetensors.index.json",
               "identity.json", "chat_identity.json"}  # the last two: the verifier stage's records, written from this id
# Counted apart from the other tokenizer files: the template by its text, the config by its keys.
NOT_TOKENIZER_FILES = MODEL_FILES | {"chat_template.jinja", "chat_template.json", "tokenizer_config.json"}
TEMPLATE_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")  # what a template may print by name
# tokenizer_config.json keys that record how the file was written, or what only decoding and
# truncation read (prompts are neither), or ids that follow from the tokens' names.
CONFIG_RECORDS = {"chat_template", "is_local", "local_files_only", "name_or_path", "_commit_hash",
                  "transformers_version", "model_max_length", "clean_up_tokenization_spaces"}
# Text that exercises normalisers and pre-tokenisers: case, runs of spaces, tabs and newlines,
# digits, composed and decomposed accents, compatibility forms, CJK, emoji, control bytes.
PROBE = ("Hello, World! HELLO world.  Two  spaces,\tone tab,\n\nnew lines;  \n  indented: x = f(3.14, -42); "
         "12345678 1,000,000 ½ x² café cafe\u0301 Ünïcödé ﬁne ＦＵＬＬ 数字と日本語 한국어 😀👍🏽 \x00\x07\x7f end ")


def tokenizer_fingerprint(folder: str | Path) -> str:
    """The id of what decides a verifier folder's prompt token ids (module docstring): equal for the same
    tokenizer and chat template however a transformers version wrote them."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    config = read_json(config_file) if config_file.is_file() else {}
    template, named = chat_template(folder, config), named_tokens(folder, config)
    if (folder / "tokenizer.json").is_file():
        encoding = fast_encoding(folder / "tokenizer.json", config, named)
    else:
        encoding = tokenizer_files(folder, config)
    printed = {role: token for role, token in named.items() if template and role in template}
    return stable_hash({"chat_template": template, "template_tokens": printed, "encoding": encoding})


def chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template's text: chat_template.jinja (transformers 5), else chat_template.json's
    or tokenizer_config.json's (older ones); of a list of named templates, the one named default."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    legacy = folder / "chat_template.json"
    template = read_json(legacy).get("chat_template") if legacy.is_file() else config.get("chat_template")
    if isinstance(template, list):
        return next((named["template"] for named in template if named.get("name") == "default"), None)
    return template


def token_content(token: str | dict) -> str:
    """A special token as a config names it: its text, or an AddedToken's serialised dict."""
    return token["content"] if isinstance(token, dict) else token


def named_tokens(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens by role, as tokenizer_config.json names them (else special_tokens_map.json)."""
    old = folder / "special_tokens_map.json"
    names = {**(read_json(old) if old.is_file() else {}), **config}
    return {role: token_content(names[role]) for role in TEMPLATE_TOKENS if names.get(role)}


def added_tokens(spec: dict[str, Any], config: dict[str, Any], named: dict[str, str]) -> dict[str, list]:
    """Every token matched in text before the model splits it, content -> [id, special]: tokenizer.json's,
    tokenizer_config.json's added_tokens_decoder, and the special tokens the config names (transformers
    adds those the file lacks, with new ids)."""
    added = {token["content"]: [token["id"], token["special"]] for token in spec.get("added_tokens", [])}
    for token_id, token in config.get("added_tokens_decoder", {}).items():
        added.setdefault(token["content"], [int(token_id), token.get("special", False)])
    for token in [*named.values(), *listed_specials(config)]:
        added.setdefault(token_content(token), [None, True])
    return added


def listed_specials(config: dict[str, Any]) -> list[str | dict]:
    """additional_special_tokens (a list) and extra_special_tokens (transformers 5: a list, or roles -> tokens)."""
    listed: list[str | dict] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        tokens = config.get(key) or []
        listed += tokens.values() if isinstance(tokens, dict) else tokens
    return listed


def fast_encoding(path: Path, config: dict[str, Any], named: dict[str, str]) -> dict[str, Any]:
    """What decides the ids a tokenizer.json gives a text (module docstring)."""
    spec = read_json(path)
    model = spec.get("model", {})
    added = added_tokens(spec, config, named)
    merges = [merge.split(" ", 1) if isinstance(merge, str) else list(merge) for merge in model.get("merges", [])]
    return {"model": model.get("type"), "vocab": model.get("vocab"), "merges": merges, "added": added,
            "probe": probe_ids(path, sorted(added))}


def probe_ids(path: Path, added: list[str]) -> list[int]:
    """The ids of ``PROBE`` and of every added token between spaces and glued to text, as the
    ``tokenizers`` library (not transformers) encodes them from ``path``."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library's errors have no finer Python type
        raise UserError(f"{path}: not a tokenizer the tokenizers library reads ({err})") from None
    text = PROBE + "".join(f" {token} \n{token}x" for token in added)
    return tokenizer.encode(text, add_special_tokens=False).ids


def tokenizer_files(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """A tokenizer without tokenizer.json: each tokenizer file's content (JSON parsed), the template
    files apart (counted as the template), tokenizer_config.json without ``CONFIG_RECORDS``."""
    hashes: dict[str, Any] = {}
    for file in sorted(folder.iterdir()):
        if file.is_file() and file.name not in NOT_TOKENIZER_FILES and not file.name.endswith(WEIGHT_SUFFIXES):
            hashes[file.name] = read_json(file) if file.suffix == ".json" else sha256_file(file)
    hashes["tokenizer_config.json"] = {key: value for key, value in config.items()
                                       if key not in CONFIG_RECORDS and not key.endswith("_token_id")}
    return hashes
