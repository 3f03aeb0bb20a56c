"""BM25 through bm25s, behind the same build / search shape as the dense indexes.

Terms are analyzer.py's (Lucene's EnglishAnalyzer, as Search-R1's pyserini BM25 has them), for passages
and queries alike: bm25s's `Tokenizer` only numbers them. Building: ingest.py tokenizes the corpus shard
by shard with one such tokenizer, writing each shard's token ids to disk (`tokens/NNNNN.ids.npy` +
`.lens.npy`) and appending the terms each shard adds to a vocabulary log, so an interrupted build resumes.
`build_bm25` then feeds the shards to bm25s as a lazy sequence (bm25s walks it a few times; no list of
21M token lists is ever held) and saves the sparse score matrix into `bm25/`. Searching maps that matrix
(`mmap=True`), scores every passage for each query and keeps the best k, equal scores in corpus order
(ranking.py); documents that share no term with the query (score 0) are not returned, and a query
without a known term has no hits. The defaults k1=0.9, b=0.4 are Lucene's / pyserini's, which
Search-R1's BM25 baseline uses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retriever.analyzer import analyze
from retriever.errors import RetrieverError
from retriever.ranking import top_k

BM25_DIR = "bm25"
TOKENIZER_VOCAB = "tokenizer_vocab.json"
# What a saved index holds (bm25s's score matrix, vocabulary and parameters, and the query tokenizer's
# vocabulary): a server checks each is there before it loads any.
INDEX_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "vocab.index.json",
               "params.index.json", TOKENIZER_VOCAB)
DEFAULT_K1, DEFAULT_B, DEFAULT_METHOD = 0.9, 0.4, "lucene"


def new_tokenizer(word_to_id: dict[str, int] | None = None):
    """A bm25s tokenizer that numbers analyzer.py's terms (it lowercases, drops and stems nothing itself),
    continuing `word_to_id` where given."""
    from bm25s.tokenization import Tokenizer

    tokenizer = Tokenizer(lower=False, splitter=analyze, stopwords=None, stemmer=None)
    if word_to_id:
        tokenizer.word_to_id = dict(word_to_id)
    return tokenizer


def tokenize_passages(tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `texts`, growing the vocabulary: (flat int32 ids, int32 length per text)."""
    docs = list(tokenizer.streaming_tokenize(texts, update_vocab=True, allow_empty=True))
    lens = np.fromiter((len(d) for d in docs), dtype=np.int32, count=len(docs))
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def save_shard(directory: Path, shard: int, flat: np.ndarray, lens: np.ndarray) -> None:
    """Write one shard's token ids; each file is renamed into place, so a reader never sees half of one."""
    for suffix, array in (("ids", flat), ("lens", lens)):
        tmp = directory / f".{shard:05d}.{suffix}.tmp.npy"
        np.save(tmp, array)
        tmp.rename(directory / f"{shard:05d}.{suffix}.npy")


class _ShardedTokenIds(Sequence):
    """The corpus's token-id lists, read back shard by shard each time bm25s iterates them."""

    def __init__(self, directory: Path, n_shards: int, n_docs: int) -> None:
        self._dir, self._n_shards, self._n_docs = directory, n_shards, n_docs

    def __len__(self) -> int:
        return self._n_docs

    def __getitem__(self, i):  # bm25s only iterates; random access would defeat the point
        raise TypeError("token ids are read sequentially")

    def __iter__(self) -> Iterator[list[int]]:
        for shard in range(self._n_shards):
            flat = np.load(self._dir / f"{shard:05d}.ids.npy")
            lens = np.load(self._dir / f"{shard:05d}.lens.npy")
            yield from (doc.tolist() for doc in np.split(flat, np.cumsum(lens)[:-1]))


@dataclass
class _Corpus:  # the "object with ids and vocab" form that bm25s.BM25.index accepts
    ids: Sequence
    vocab: dict[str, int]


def build_bm25(
    tokens_dir: Path, n_shards: int, n_docs: int, tokenizer, out_dir: Path, k1: float, b: float, method: str
) -> None:
    """Score the tokenized corpus and save the index plus the query tokenizer's vocabulary in `out_dir`."""
    import bm25s

    retriever = bm25s.BM25(k1=k1, b=b, method=method)
    vocab = tokenizer.get_vocab_dict()
    retriever.index(_Corpus(_ShardedTokenIds(tokens_dir, n_shards, n_docs), vocab), show_progress=False)
    retriever.save(str(out_dir), show_progress=False)
    (out_dir / TOKENIZER_VOCAB).write_text(json.dumps(tokenizer.word_to_id, ensure_ascii=False))


class Bm25Search:
    """A saved BM25 index, memory-mapped; `search` returns (scores, rows) padded with -1 past the hits."""

    def __init__(self, directory: Path, *, mmap: bool = True, threads: int | None = None) -> None:
        import bm25s

        for name in INDEX_FILES:
            if not (directory / name).is_file():
                raise RetrieverError(f"{directory / name} is missing: the BM25 index is incomplete; rebuild the index")
        try:
            self._index = bm25s.BM25.load(str(directory), mmap=mmap, load_corpus=False, show_progress=False)
        except (ValueError, OSError, KeyError) as e:  # numpy's "mmap length is greater than file size", ...
            raise RetrieverError(f"{directory}: bm25s cannot load it ({e}): a file is truncated or corrupt; "
                                 "rebuild the index") from None
        word_to_id = json.loads((directory / TOKENIZER_VOCAB).read_text())
        self._tokenizer = new_tokenizer(word_to_id)
        self._empty = word_to_id.get("")
        self.size = int(self._index.scores["num_docs"])
        workers = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="bm25") if workers > 1 else None

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of the k best passages of each query, best first, equal scores in corpus order
        (bm25s's own top-k returns them last-indexed first); rows -1 past the passages sharing a term."""
        k = min(k, self.size)
        ids = list(self._tokenizer.streaming_tokenize(queries, update_vocab=False, allow_empty=True))
        if len(ids) > 1 and self._pool is not None:  # numpy releases the GIL: queries score in parallel
            hits = list(self._pool.map(lambda q: self._search_one(q, k), ids))
        else:
            hits = [self._search_one(q, k) for q in ids]
        scores = np.zeros((len(ids), k), dtype=np.float32)
        rows = np.full((len(ids), k), -1, dtype=np.int64)
        for i, (s, r) in enumerate(hits):
            scores[i, : len(r)], rows[i, : len(r)] = s, r
        return scores, rows

    def _search_one(self, token_ids: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
        # A query with no known term is tokenized to the empty token, which matches the empty passages:
        # it has no hits, like a Lucene query with no terms.
        if all(t == self._empty for t in token_ids):
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        scores = self._index.get_scores_from_ids(token_ids)
        rows = top_k(scores, k)
        rows = rows[scores[rows] > 0]  # only passages that share a term with the query
        return scores[rows], rows
