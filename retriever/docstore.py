"""The documents of an index directory: each corpus row (every field) by integer row, without loading the
corpus.

Two files: `docs.jsonl` (one `{"id", "contents", ...}` object a line, the index's row order) and
`docs.offsets.bin` (little-endian int64, the byte offset where each row starts). The writer appends
both during a build and can be truncated back to a committed row count (a resumed build, ingest.py);
the reader refuses a store whose files were cut short at start-up (the last row must start before the
end of `docs.jsonl` and end with its newline), and reads (os.pread, no memory map: see DocStore) and
parses only the rows a search returns (server.py); a file cut short later fails only the requests for
rows past its new end. A passage costs 8 bytes of offsets on disk and no Python object until it is
asked for.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from retriever.errors import RetrieverError

DOCS_FILE = "docs.jsonl"
OFFSETS_FILE = "docs.offsets.bin"
_OFFSET = np.dtype("<i8")
_OFFSET_STRUCT = struct.Struct("<q")
_PAIR_STRUCT = struct.Struct("<qq")  # a row's offset and the next one's: one read gives a row's span


class DocStoreWriter:
    """Appends rows; `commit()` flushes to disk and returns (rows, bytes) for the build state."""

    def __init__(self, directory: Path, rows: int = 0, nbytes: int = 0) -> None:
        docs, offsets = directory / DOCS_FILE, directory / OFFSETS_FILE
        for path in (docs, offsets):
            path.touch()
        # A resumed build continues from the last committed shard: drop whatever came after it.
        os.truncate(docs, nbytes)
        os.truncate(offsets, rows * _OFFSET.itemsize)
        self._docs = open(docs, "ab")  # noqa: SIM115 - closed in close()
        self._offsets = open(offsets, "ab")  # noqa: SIM115
        self.rows, self.nbytes = rows, nbytes

    def append(self, line: bytes) -> None:
        self._offsets.write(_OFFSET_STRUCT.pack(self.nbytes))  # same bytes as _OFFSET, without an array
        self._docs.write(line)
        self.rows += 1
        self.nbytes += len(line)

    def commit(self) -> tuple[int, int]:
        for f in (self._docs, self._offsets):
            f.flush()
            os.fsync(f.fileno())
        return self.rows, self.nbytes

    def close(self) -> None:
        self._docs.close()
        self._offsets.close()


class DocStore:
    """Read-only rows of an index directory; `get(rows)` parses just those rows.

    Rows are read with os.pread, not through a memory map: a file cut short under a running server (a
    truncate, an in-place restore) turns a read of a mapped page past its new end into SIGBUS, which kills
    the server; a pread just comes back short, and only the requests reading such rows get an error
    (RetrieverError naming the file, a 500 from server.py) while intact rows keep being served."""

    def __init__(self, directory: Path) -> None:
        docs, offsets = directory / DOCS_FILE, directory / OFFSETS_FILE
        if not docs.exists() or not offsets.exists():
            raise RetrieverError(f"{directory}: missing {DOCS_FILE} or {OFFSETS_FILE}; not a complete index directory")
        self._docs_path, self._offsets_path = docs, offsets
        self._docs_fd = os.open(docs, os.O_RDONLY | os.O_CLOEXEC)
        self._offsets_fd = os.open(offsets, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._docs_fd).st_size
        offsets_bytes = os.fstat(self._offsets_fd).st_size
        if offsets_bytes % _OFFSET.itemsize:
            self.close()
            raise RetrieverError(f"{offsets}: {offsets_bytes} bytes, not a whole number of 8-byte offsets: the file is "
                                 "truncated; rebuild the index")
        self._rows = offsets_bytes // _OFFSET.itemsize
        if self._rows:
            last = _OFFSET_STRUCT.unpack(os.pread(self._offsets_fd, _OFFSET.itemsize, offsets_bytes - _OFFSET.itemsize))[0]
            if self._size <= last or os.pread(self._docs_fd, 1, self._size - 1) != b"\n":  # every row ends in a newline
                self.close()
                raise RetrieverError(f"{docs}: {self._size} bytes, and its last row (from byte {last}, as {OFFSETS_FILE} "
                                     "says) is not all there: the file is truncated; rebuild the index")

    def __len__(self) -> int:
        return self._rows

    def _span(self, row: int) -> tuple[int, int]:
        """Where `row` lies in docs.jsonl: its offset and the next row's (the file's size for the last row)."""
        if not 0 <= row < self._rows:
            raise IndexError(f"row {row} of a docs store of {self._rows} rows")
        last = row + 1 == self._rows
        want = _OFFSET.itemsize if last else 2 * _OFFSET.itemsize
        raw = os.pread(self._offsets_fd, want, row * _OFFSET.itemsize)
        if len(raw) != want:
            raise RetrieverError(self._cut_short(self._offsets_path, self._offsets_fd, row,
                                                 f"its offset at byte {row * _OFFSET.itemsize}"))
        if last:
            return _OFFSET_STRUCT.unpack(raw)[0], self._size
        return _PAIR_STRUCT.unpack(raw)

    def get(self, row: int) -> dict[str, Any]:
        start, end = self._span(row)
        line = os.pread(self._docs_fd, end - start, start) if 0 <= start < end else b""
        if len(line) != end - start or not line:
            raise RetrieverError(self._cut_short(self._docs_path, self._docs_fd, row, f"bytes {start}..{end}"))
        try:
            return json.loads(line)
        except ValueError:  # the bytes are there but are not the row: the file was rewritten in place
            raise RetrieverError(f"{self._docs_path}: row {row} (bytes {start}..{end}) is not a JSON row: the file "
                                 "changed under the running server; rebuild or restore the index") from None

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        # The serving path: two preads and a parse per row, inlined (get() is the checked slow path that
        # names what is wrong, taken for a row whose read comes back short or does not parse).
        pread, loads, unpack = os.pread, json.loads, _PAIR_STRUCT.unpack
        docs_fd, offsets_fd, with_next = self._docs_fd, self._offsets_fd, self._rows - 1  # rows below it have a next row
        out = []
        for row in rows:
            if 0 <= row < with_next:
                raw = pread(offsets_fd, 16, row * 8)
                if len(raw) == 16:
                    start, end = unpack(raw)
                    if 0 <= start < end:
                        line = pread(docs_fd, end - start, start)
                        if len(line) == end - start:
                            try:
                                out.append(loads(line))
                                continue
                            except ValueError:
                                pass
            out.append(self.get(row))
        return out

    @staticmethod
    def _cut_short(path: Path, fd: int, row: int, where: str) -> str:
        return (f"{path}: row {row} ({where}) is past the file's end ({os.fstat(fd).st_size} bytes now): the file was "
                "cut short under the running server; rebuild or restore the index (intact rows are still served)")

    def close(self) -> None:
        for fd in (self._docs_fd, self._offsets_fd):
            try:
                os.close(fd)
            except OSError:  # closed already
                pass
        self._docs_fd = self._offsets_fd = -1
