"""Recall@10 of HNSW and IVF-PQ against Flat on a synthetic corpus, over loopback HTTP.

Flat is exact, so its top 10 is the reference. HNSW and IVF-PQ are built from the Flat index's vectors
(reindex.py), served, and queried with the same queries; the recall is printed (run pytest with -s to see
it) and bounded below. The bounds sit well under the measured values (HNSW ~1.0, IVF-PQ ~0.55 here) so
they catch a broken index (wrong metric, unnormalised vectors, nprobe ignored), not noise. IVF-PQ at its
defaults (4 dims per PQ sub-quantizer, no re-ranking) loses much of its recall on the near-collinear
vectors of a random tiny BERT; more sub-quantizers (--pq-m) buy it back.
"""

from __future__ import annotations

import httpx
import pytest

from retriever.reindex import reindex
from tests.test_retriever_support import (
    THREADS,
    build_index,
    make_tiny_encoder,
    serve_index,
    synthetic_corpus_file,
)

N_PASSAGES, N_QUERIES, K = 2000, 100, 10
RECALL_FLOOR = {"hnsw": 0.9, "ivfpq": 0.4}


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory)


def _top_ids(url: str, queries: list[str]) -> list[list[str]]:
    body = {"queries": queries, "topk": K, "return_scores": True}
    result = httpx.post(f"{url}/retrieve", json=body, timeout=120).json()["result"]
    return [[h["document"]["id"] for h in hits] for hits in result]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory, tiny_encoder):
    root = tmp_path_factory.mktemp("recall")
    path, corpus = synthetic_corpus_file(root / "corpus.jsonl", N_PASSAGES)
    build_index(path, root / "flat", "flat", encoder=str(tiny_encoder), shard_size=500)
    reindex(root / "flat", root / "hnsw", "hnsw", {}, threads=THREADS)
    reindex(root / "flat", root / "ivfpq", "ivfpq", {}, threads=THREADS)
    return root, corpus.queries(N_QUERIES)


def test_recall_at_10_against_flat(indexes, record_property):
    root, queries = indexes
    with serve_index(root / "flat") as url:
        exact = _top_ids(url, queries)
    assert all(len(ids) == K for ids in exact)
    for index_type, floor in RECALL_FLOOR.items():
        with serve_index(root / index_type, mmap=True) as url:  # served from a memory map
            approx = _top_ids(url, queries)
        recall = sum(len(set(a) & set(e)) for a, e in zip(approx, exact, strict=True)) / (K * len(queries))
        print(f"\nrecall@{K} of {index_type} vs flat on {N_PASSAGES} synthetic passages: {recall:.3f}")
        record_property(f"recall_at_{K}_{index_type}", round(recall, 4))
        assert recall >= floor, f"{index_type} recall@{K} {recall:.3f} < {floor}"
