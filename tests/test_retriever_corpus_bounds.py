"""Corpus lines no parse can take (retriever/corpus.py): a line nested too deeply for the JSON parser, and a
line longer than the bound derived from --max-passage-chars (a corpus without newlines: a pipe, a device, a
blob), are bad lines like any other: named, or skipped and counted with --skip-bad, never a traceback or a
read without bound."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from retriever.corpus import CorpusReader
from retriever.errors import RetrieverError
from tests.test_retriever_support import HAND_CORPUS, build_index

DEEP = 100_000
HUGE = 10 << 20  # a 10 MiB line: far over the bound for --max-passage-chars 100 (and for the default)
SMALL_CAP = 100


class CountingStream:
    """A binary file that records how much each call handed back: the reader must take a huge line in
    bounded pieces and stop reading a line it refuses."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 - closed by the test through close()
        self.chunks: list[int] = []

    def _note(self, data: bytes) -> bytes:
        self.chunks.append(len(data))
        return data

    def read(self, n: int = -1) -> bytes:
        return self._note(self._f.read(n))

    def readline(self, limit: int = -1) -> bytes:
        return self._note(self._f.readline(limit))

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        line = self._f.readline()
        if not line:
            raise StopIteration
        return self._note(line)

    def close(self) -> None:
        self._f.close()


def _good(i: int) -> bytes:
    return (json.dumps(HAND_CORPUS[i]) + "\n").encode()


@pytest.mark.parametrize("deep", ["[" * DEEP + "]" * DEEP, '{"id": "d", "contents": ' + "[" * DEEP + "]" * DEEP + "}"])
def test_a_deeply_nested_line_is_a_bad_line(tmp_path, deep):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(_good(0) + deep.encode() + b"\n" + _good(1))
    with pytest.raises(RetrieverError, match=r"corpus line 2: nested too deeply") as refused:
        build_index(corpus, tmp_path / "idx", "bm25")
    assert "--skip-bad" in str(refused.value)
    manifest = build_index(corpus, tmp_path / "idx", "bm25", skip_bad=True)
    assert (manifest.corpus.rows, manifest.corpus.skipped_lines) == (2, 1)
    assert manifest.build["first_skipped"][0].startswith("corpus line 2: nested too deeply")


def test_a_line_without_end_is_refused_without_reading_it_all(tmp_path):
    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * HUGE)  # one line, no newline: a blob, or what a device or a pipe would give
    stream = CountingStream(blob)
    try:
        with pytest.raises(RetrieverError, match=r"corpus line 1: longer than [\d,]+ bytes.*--max-passage-chars"):
            list(CorpusReader(stream, max_chars=SMALL_CAP))
    finally:
        stream.close()
    assert sum(stream.chunks) < 1 << 20, f"read {sum(stream.chunks)} bytes of a line it refused"
    with pytest.raises(RetrieverError, match=r"corpus line 1: longer than"):
        build_index(blob, tmp_path / "idx", "bm25", max_passage_chars=SMALL_CAP)
    assert not (tmp_path / "idx").exists()


def test_skip_bad_skips_a_huge_line_in_bounded_reads_and_keeps_counting(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(_good(0) + b"a" * HUGE + b"\n" + _good(1) + b"b" * HUGE)  # the last line has no newline
    stream = CountingStream(corpus)
    try:
        reader = CorpusReader(stream, skip_bad=True, max_chars=SMALL_CAP)
        lines = list(reader)
    finally:
        stream.close()
    assert [line.passage.row if line.passage else None for line in lines] == [HAND_CORPUS[0], None, HAND_CORPUS[1], None]
    assert lines[1].error.startswith("corpus line 2: longer than") and lines[3].error.startswith("corpus line 4:")
    assert max(stream.chunks) < 1 << 20, f"one read handed back {max(stream.chunks)} bytes"
    # every byte is still counted and hashed: the manifest's size and checksum stay the corpus's
    assert reader.offset == corpus.stat().st_size and reader.line_no == 4
    assert reader.sha256() == hashlib.sha256(corpus.read_bytes()).hexdigest()
    manifest = build_index(corpus, tmp_path / "idx", "bm25", skip_bad=True, max_passage_chars=SMALL_CAP)
    assert (manifest.corpus.rows, manifest.corpus.skipped_lines, manifest.corpus.bytes) == (2, 2, corpus.stat().st_size)


def test_a_line_over_the_cap_but_within_the_bound_is_still_cut(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "long", "contents": "y" * (30 * SMALL_CAP)}) + "\n")
    manifest = build_index(corpus, tmp_path / "idx", "bm25", max_passage_chars=SMALL_CAP)
    assert (manifest.corpus.rows, manifest.corpus.truncated, manifest.corpus.skipped_lines) == (1, 1, 0)
