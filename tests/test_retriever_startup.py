"""Start-up checks of `retriever serve` (searcher.py, docstore.py, faiss_index.py, bm25.py): an index
directory with a file cut short or missing is refused before the server listens, with one line naming the
file, instead of answering 500s at query time or printing a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from retriever.errors import RetrieverError
from retriever.searcher import open_index
from tests.test_retriever_support import HAND_CORPUS, REPO, THREADS, build_index, make_tiny_bert, write_jsonl


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    corpus = write_jsonl(root / "c.jsonl", HAND_CORPUS)
    build_index(corpus, root / "flat", "flat", encoder=str(make_tiny_bert(root / "tiny-encoder")))
    build_index(corpus, root / "bm25", "bm25")
    return root


def _cut(path, n_bytes: int) -> None:
    os.truncate(path, path.stat().st_size - n_bytes)


CASES = {
    "docs store cut inside its last row": ("bm25", lambda d: _cut(d / "docs.jsonl", 5),
                                           r"docs\.jsonl: \d+ bytes, and its last row \(from byte \d+.* truncated"),
    "docs store cut before its last row": ("bm25", lambda d: _cut(d / "docs.jsonl", 150),
                                           r"docs\.jsonl: \d+ bytes, and its last row .* truncated"),
    "offsets cut mid-offset": ("bm25", lambda d: _cut(d / "docs.offsets.bin", 3),
                               r"docs\.offsets\.bin: 61 bytes, not a whole number of 8-byte offsets"),
    "FAISS file cut short": ("flat", lambda d: _cut(d / "index.faiss", 100),
                             r"index\.faiss: faiss cannot read it \(read error .*\): the file is truncated or corrupt"),
    "BM25 score matrix missing": ("bm25", lambda d: (d / "bm25" / "data.csc.index.npy").unlink(),
                                  r"bm25/data\.csc\.index\.npy is missing: the BM25 index is incomplete"),
    "BM25 vocabulary missing": ("bm25", lambda d: (d / "bm25" / "tokenizer_vocab.json").unlink(),
                                r"bm25/tokenizer_vocab\.json is missing"),
    "BM25 score matrix cut short": ("bm25", lambda d: _cut(d / "bm25" / "data.csc.index.npy", 8),
                                    r"bm25s cannot load it \(.*\): a file is truncated or corrupt"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mmap", [False, True])
def test_a_damaged_index_is_refused_with_one_line(built, tmp_path, case, mmap):
    kind, damage, message = CASES[case]
    copy = shutil.copytree(built / kind, tmp_path / kind)
    damage(copy)
    with pytest.raises(RetrieverError, match=message) as refused:
        open_index(copy, threads=THREADS, mmap=mmap)
    assert "\n" not in str(refused.value) and "rebuild the index" in str(refused.value)


def test_serve_prints_the_one_line_and_exits(built, tmp_path):
    copy = shutil.copytree(built / "flat", tmp_path / "flat")
    _cut(copy / "index.faiss", 100)
    result = subprocess.run([sys.executable, "-m", "retriever", "serve", "--index", str(copy), "--mmap"],
                            capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {copy / 'index.faiss'}: faiss cannot read it")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_an_intact_index_opens(built):
    for kind in ("flat", "bm25"):
        assert open_index(built / kind, threads=THREADS).index.size == len(HAND_CORPUS)
