"""Reading a Search-R1 / wiki-18 corpus: one JSON object `{"id": ..., "contents": "\"Title\"\ntext"}` a line.

`CorpusReader` streams the file in binary (so it also reads a pipe), keeps the byte offset and line number
of every line (a resumed build restarts at a byte offset, and errors name the line), and hashes the bytes
as it goes (the manifest records the corpus checksum). Each row is kept whole, every field of it (`title`,
`text`, ... where the corpus has them), as Search-R1's dense server returns its rows; every string field
is cut to `max_chars` characters (the per-passage cap), and the passage says whether it was cut and
whether its `contents` is empty. A line is read only up to a bound derived from the cap (max_line_bytes):
a longer one, and one nested too deeply for the JSON parser, is a bad line like any other (named, or
skipped and counted with --skip-bad), so no line costs more memory than the bound. ingest.py drives it;
nothing here holds the corpus.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from retriever.errors import RetrieverError

_HASH_BLOCK = 1 << 24
DEFAULT_MAX_PASSAGE_CHARS = 16384  # far past what a 512-token encoder reads of real text; bounds a huge line's cost
# The bound on a line's length, in bytes: 64 per character of the cap, plus 64 KiB. A row at the cap can
# hold several fields at it (`contents`, `text`, `title`), each up to 6 bytes a character once JSON-escaped
# (`\u00e9`), beside its id and keys; a field somewhat over the cap is still read, and cut. Past the bound a
# line is a bad line: what has no newline for that long (a blob, a device, a pipe of something else) is
# refused before it fills memory. 1.06 MiB for the default cap.
_LINE_BYTES_PER_CHAR = 64
_LINE_OVERHEAD_BYTES = 64 << 10
_SKIP_BLOCK = 64 << 10  # a bad line too long to keep is skipped (and hashed) in reads of this size


def max_line_bytes(max_chars: int) -> int:
    """The longest corpus line read, in bytes (newline included), for a cap of `max_chars` characters."""
    return _LINE_BYTES_PER_CHAR * max_chars + _LINE_OVERHEAD_BYTES


@dataclass(frozen=True)
class Passage:
    """One corpus row as the index stores and serves it: every field of the row, `id` first (the row number
    where the row has none), each string cut to the cap; `contents` is what is encoded or tokenized."""

    row: dict[str, Any]
    truncated: bool = False  # some string field was longer than the cap and was cut

    @property
    def id(self) -> Any:
        return self.row["id"]

    @property
    def contents(self) -> str:
        return self.row["contents"]

    @property
    def empty(self) -> bool:
        return not self.contents.strip()

    def to_json_line(self) -> bytes:
        return (json.dumps(self.row, ensure_ascii=False, allow_nan=False) + "\n").encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; expected finite numbers only")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows to a non-finite number; expected finite numbers only")
    return value


def parse_line(raw: bytes, line_no: int, row: int, max_chars: int = DEFAULT_MAX_PASSAGE_CHARS) -> Passage:
    """Parse one corpus line, or raise RetrieverError naming the line and what is wrong with it.

    A missing `id` falls back to the row number (as a string, like wiki-18's ids); `contents` is required.
    String fields longer than `max_chars` characters are cut there (Passage.truncated says so).
    """
    try:
        obj = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RetrieverError(f"corpus line {line_no}: not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    except RecursionError:  # the parser recurses once per level of [ or {: a row is never that deep
        raise RetrieverError(f"corpus line {line_no}: nested too deeply for the JSON parser (arrays or objects "
                             'inside each other); expected a flat {"id": ..., "contents": "..."} object') from None
    except ValueError as e:  # NaN / Infinity: no JSON answer could carry them back to a client
        raise RetrieverError(f"corpus line {line_no}: {e}") from None
    if not isinstance(obj, dict):
        raise RetrieverError(f"corpus line {line_no}: expected a JSON object, got {type(obj).__name__}")
    contents = obj.get("contents")
    if not isinstance(contents, str):
        what = "lacks a `contents` field" if contents is None else f"has a non-string `contents` ({type(contents).__name__})"
        raise RetrieverError(f'corpus line {line_no}: {what}; expected {{"id": ..., "contents": "\\"Title\\"\\ntext"}}')
    fields = {"id": obj.get("id", str(row)), **obj}
    long = [k for k, v in fields.items() if isinstance(v, str) and len(v) > max_chars]
    for key in long:
        fields[key] = fields[key][:max_chars]
    passage = Passage(fields, truncated=bool(long))
    try:
        passage.to_json_line()  # JSON's \ud800 escapes decode to lone surrogates, which UTF-8 cannot hold
    except UnicodeEncodeError as e:
        raise RetrieverError(f"corpus line {line_no}: a lone UTF-16 surrogate ({e.object[e.start:e.end]!r}) that "
                             "UTF-8 cannot encode") from None
    except RecursionError:  # parsed just under the limit, too deep to write back
        raise RetrieverError(f"corpus line {line_no}: nested too deeply to store (arrays or objects inside each "
                             'other); expected a flat {"id": ..., "contents": "..."} object') from None
    return passage


def sha256_of(path: Path) -> str:
    """The hash the manifest records for a corpus file, computed from the file as it is now."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class CorpusLine:
    """A line read from the corpus: its parse, or why it could not be parsed (the reader keeps positions)."""

    passage: Passage | None  # None: a bad line skipped under --skip-bad
    error: str | None = None


class CorpusReader:
    """Streams a corpus from `start_offset` (a resumed build), checking that the bytes before it are the
    ones the interrupted build read (`prefix_sha256`), and hashing everything it reads."""

    def __init__(
        self,
        stream: BinaryIO,
        *,
        skip_bad: bool = False,
        max_chars: int = DEFAULT_MAX_PASSAGE_CHARS,
        start_offset: int = 0,
        start_line: int = 0,
        start_row: int = 0,
        prefix_sha256: str | None = None,
    ) -> None:
        self._stream = stream
        self._skip_bad = skip_bad
        self._max_chars = max_chars
        self._hash = hashlib.sha256()
        self.offset = 0
        self.line_no = start_line
        self.row = start_row
        if start_offset:
            self._consume_prefix(start_offset, prefix_sha256)

    def _consume_prefix(self, n_bytes: int, expected: str | None) -> None:
        left = n_bytes
        while left:
            block = self._stream.read(min(left, _HASH_BLOCK))
            if not block:
                raise RetrieverError(
                    f"cannot resume: the corpus is shorter ({n_bytes - left} bytes) than what the interrupted "
                    f"build had read ({n_bytes} bytes); pass --restart to build it from the start"
                )
            self._hash.update(block)
            left -= len(block)
        self.offset = n_bytes
        if expected is not None and self._hash.hexdigest() != expected:
            raise RetrieverError(
                f"cannot resume: the first {n_bytes} bytes of the corpus differ from those the interrupted build "
                "read (the corpus changed since); pass --restart to build it from the start"
            )

    def sha256(self) -> str:
        """The hash of every byte read so far (the whole corpus, once the reader is exhausted)."""
        return self._hash.hexdigest()

    def _read(self, limit: int) -> bytes:
        raw = self._stream.readline(limit)
        self._hash.update(raw)
        self.offset += len(raw)
        return raw

    def __iter__(self) -> Iterator[CorpusLine]:
        bound = max_line_bytes(self._max_chars)
        while raw := self._read(bound + 1):  # never more than the bound in memory, newline or not
            self.line_no += 1
            if not raw.strip():
                continue  # blank lines (a trailing newline, a separator) carry no passage
            try:
                if len(raw) > bound:
                    raise RetrieverError(
                        f"corpus line {self.line_no}: longer than {bound:,} bytes, the bound on a line (64 bytes a "
                        f"character of --max-passage-chars {self._max_chars}, plus 64 KiB); expected one JSON object "
                        "a line (is the corpus JSONL, with newlines?)"
                    )
                passage = parse_line(raw, self.line_no, self.row, self._max_chars)
            except RetrieverError as e:
                if not raw.endswith(b"\n") and self._skip_bad:
                    while (rest := self._read(_SKIP_BLOCK)) and not rest.endswith(b"\n"):
                        pass  # the rest of a line too long to keep: read (and hashed) in bounded pieces
                if not self._skip_bad:
                    raise RetrieverError(f"{e} (pass --skip-bad to skip and count such lines)") from None
                yield CorpusLine(None, str(e))
                continue
            self.row += 1
            yield CorpusLine(passage)
