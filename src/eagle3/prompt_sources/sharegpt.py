"""ShareGPT-style JSON (an array of ``{"conversations": [{"from", "value"}, ...]}``), read as a
stream: the file may be large (the packaged ShareGPT V3 copy is 125 MB) and cut off mid-record,
in which case the complete records before the cut are read and the cut is reported.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3.common import UserError
from eagle3.prompt_sources.messages import SHAREGPT_ROLES

CHUNK = 1 << 20


class ConversationFile:
    """The records of a JSON array in file order, as (record, its raw JSON text); after iterating,
    ``cut`` says whether the file ended inside the array (truncated) and ``records`` how many were read."""

    def __init__(self, path: Path):
        self.path, self.cut, self.records = path, False, 0
        self.decoder = json.JSONDecoder()

    def __iter__(self) -> Iterator[tuple[object, str]]:
        text = Text(self.path)
        if not text.expect("["):
            raise UserError(f"{self.path}: not a JSON array; give a list of {{\"conversations\": [...]}} records")
        while True:
            if not text.skip_separators():
                self.cut = True  # the file ended before the array's closing bracket
                return
            if text.peek() == "]":
                return
            try:
                record, end = self.decoder.raw_decode(text.buffer, text.pos)
            except json.JSONDecodeError as err:
                if text.more():
                    continue  # the record goes on in the next chunk
                if truncated(err, text.buffer):
                    self.cut = True
                    return
                raise UserError(f"{self.path}: record {self.records + 1} is not valid JSON ({err.msg}); fix it or cut "
                                "the file before it") from None
            self.records += 1
            yield record, text.buffer[text.pos:end]
            text.pos = end


def truncated(err: json.JSONDecodeError, buffer: str) -> bool:
    """Whether a decode error at the end of the file is a cut (the text stops mid-record), not bad JSON."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(buffer.rstrip())


class Text:
    """A UTF-8 file decoded chunk by chunk: ``buffer[pos:]`` is what is not parsed yet. A multi-byte
    character cut at the end of the file belongs to the cut, not to an error."""

    def __init__(self, path: Path):
        self.handle = path.open("rb")
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buffer, self.pos, self.path = "", 0, path

    def more(self) -> bool:
        """Append the next chunk (dropping what is parsed); False at the end of the file."""
        data = self.handle.read(CHUNK)
        if not data:
            self.handle.close()
            return False
        try:
            decoded = self.decoder.decode(data)
        except UnicodeDecodeError as err:
            raise UserError(f"{self.path}: not UTF-8 ({err.reason}); re-save it as UTF-8") from None
        self.buffer, self.pos = self.buffer[self.pos:] + decoded, 0
        return True

    def skip_separators(self) -> bool:
        """Move past whitespace and commas; False if the file ends first."""
        while True:
            while self.pos < len(self.buffer) and self.buffer[self.pos] in " \t\r\n,":
                self.pos += 1
            if self.pos < len(self.buffer) or not self.more():
                return self.pos < len(self.buffer)

    def expect(self, char: str) -> bool:
        if not self.skip_separators() or self.peek() != char:
            return False
        self.pos += 1
        return True

    def peek(self) -> str:
        return self.buffer[self.pos]


def human_turn_prompts(record: object) -> Iterator[tuple[int, dict]]:
    """(turn index, prompt record) for each human turn of a conversation, with the turns before it:
    a record ``{"conversations": turns[: i + 1]}`` that ends with that user turn."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return
    for index, turn in enumerate(turns):
        if isinstance(turn, dict) and SHAREGPT_ROLES.get(turn.get("from") or turn.get("role")) == "user":
            yield index, {"conversations": turns[: index + 1]}
