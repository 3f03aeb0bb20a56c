"""The documents of an index directory: each corpus row (every field) by integer row, without loading the
corpus.

Two files: `docs.jsonl` (one `{"id", "contents", ...}` object a line, the index's row order) and
`docs.offsets.bin` (little-endian int64, the byte offset where each row starts). The writer appends
both during a build and can be truncated back to a committed row count (a resumed build, ingest.py);
the reader maps both, refuses a store whose files were cut short (the last row must start before the
end of `docs.jsonl` and end with its newline), and parses only the rows a search returns (server.py).
A passage costs 8 bytes of offsets and no Python object until it is asked for.
"""

from __future__ import annotations

import json
import mmap
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
    """Read-only rows of an index directory; `get(rows)` parses just those rows."""

    def __init__(self, directory: Path) -> None:
        docs, offsets = directory / DOCS_FILE, directory / OFFSETS_FILE
        if not docs.exists() or not offsets.exists():
            raise RetrieverError(f"{directory}: missing {DOCS_FILE} or {OFFSETS_FILE}; not a complete index directory")
        self._size = docs.stat().st_size
        offsets_bytes = offsets.stat().st_size
        if offsets_bytes % _OFFSET.itemsize:
            raise RetrieverError(f"{offsets}: {offsets_bytes} bytes, not a whole number of 8-byte offsets: the file is "
                                 "truncated; rebuild the index")
        n = offsets_bytes // _OFFSET.itemsize
        self._offsets = np.memmap(offsets, dtype=_OFFSET, mode="r", shape=(n,)) if n else np.zeros(0, _OFFSET)
        self._file = open(docs, "rb")  # noqa: SIM115 - closed in close()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if self._size else b""
        if n and (self._size <= int(self._offsets[-1]) or self._map[-1:] != b"\n"):  # every row ends in a newline
            self.close()
            raise RetrieverError(f"{docs}: {self._size} bytes, and its last row (from byte {int(self._offsets[-1])}, as "
                                 f"{OFFSETS_FILE} says) is not all there: the file is truncated; rebuild the index")

    def __len__(self) -> int:
        return int(self._offsets.shape[0])

    def get(self, row: int) -> dict[str, Any]:
        start = int(self._offsets[row])
        end = int(self._offsets[row + 1]) if row + 1 < len(self) else self._size
        return json.loads(self._map[start:end])

    def get_many(self, rows: list[int]) -> list[dict[str, Any]]:
        return [self.get(r) for r in rows]

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap) and not self._map.closed:
            self._map.close()
        self._file.close()
