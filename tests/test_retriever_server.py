"""retriever/server.py and batching.py over loopback HTTP: exact Flat results with the embedded MiniLM,
BM25 ranks and scores against a hand-written BM25, Search-R1's schema both ways, bad input, and dynamic
batching (merged deterministically, and correct under concurrent load)."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from retriever.batching import DynamicBatcher, split_hits
from retriever.encoder import DEFAULT_ENCODER, resolve_model_dir
from tests.test_retriever_support import (
    HAND_CORPUS,
    build_index,
    reference_embeddings,
    serve_index,
    write_jsonl,
)

BM25_CORPUS = [
    {"id": "a", "contents": '"Paris"\nparis capital france'},
    {"id": "b", "contents": '"Berlin"\nberlin capital germany'},
    {"id": "c", "contents": '"Cheese"\nfrance cheese france wine'},
    {"id": "d", "contents": '"Tokyo"\ntokyo capital japan sushi sushi'},
    {"id": "e", "contents": '"Wine"\nwine grapes'},
]


def lucene_bm25(query: str, docs: list[str], k1: float = 0.9, b: float = 0.4) -> list[float]:
    """BM25 as Lucene scores it, written out here (these texts hold no stop words, no one-letter words, and
    no two words with one stem, so their words stand for their terms)."""
    toks = [re.findall(r"\w\w+", d.lower()) for d in docs]
    avgdl = sum(map(len, toks)) / len(toks)
    scores = []
    for doc in toks:
        tf, s = Counter(doc), 0.0
        for term in set(re.findall(r"\w\w+", query.lower())):
            df = sum(term in t for t in toks)
            if tf[term]:
                idf = math.log(1 + (len(toks) - df + 0.5) / (df + 0.5))
                s += idf * tf[term] / (tf[term] + k1 * (1 - b + b * len(doc) / avgdl))
        scores.append(s)
    return scores


@pytest.fixture(scope="module")
def bm25_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bm25")
    build_index(write_jsonl(root / "c.jsonl", BM25_CORPUS), root / "idx", "bm25")
    return root / "idx"


@pytest.fixture(scope="module")
def bm25_url(bm25_dir):
    with serve_index(bm25_dir, max_queries=5, max_results=12, max_query_chars=50, max_body_bytes=2000) as url:
        yield url


@pytest.mark.parametrize("query", ["capital france", "wine", "sushi capital", "france cheese grapes"])
def test_bm25_ranks_and_scores(bm25_url, query):
    expected = {d["id"]: s for d, s in zip(BM25_CORPUS, lucene_bm25(query, [d["contents"] for d in BM25_CORPUS]), strict=True) if s > 0}
    hits = httpx.post(f"{bm25_url}/retrieve", json={"queries": [query], "topk": 5, "return_scores": True}).json()["result"][0]
    got = {h["document"]["id"]: h["score"] for h in hits}
    assert got.keys() == expected.keys()  # every passage sharing a term, and no other
    np.testing.assert_allclose([got[i] for i in expected], list(expected.values()), rtol=1e-5)
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)  # ranked (tied passages in either order)


def test_bm25_hand_checked_top_hit_and_no_match(bm25_url):
    body = {"queries": ["capital france", "zebra"], "topk": 2, "return_scores": True}
    top, none = httpx.post(f"{bm25_url}/retrieve", json=body).json()["result"]
    assert top[0]["document"] == BM25_CORPUS[0]  # the only passage with both terms
    assert none == []


def test_return_scores_false_returns_bare_documents(bm25_url):
    result = httpx.post(f"{bm25_url}/retrieve", json={"queries": ["capital france"], "topk": 1}).json()
    assert result == {"result": [[BM25_CORPUS[0]]]}


@pytest.mark.parametrize("topk", ["absent", None, 0])
def test_default_topk_is_three_when_topk_is_absent_null_or_zero(bm25_url, topk):
    """Search-R1's server reads `not topk` as "use the default": null and 0 alike."""
    body = {"queries": ["capital"], "return_scores": True} | ({} if topk == "absent" else {"topk": topk})
    hits = httpx.post(f"{bm25_url}/retrieve", json=body).json()["result"][0]
    assert [h["document"]["id"] for h in hits] == ["a", "b", "d"]  # the three passages with "capital"


def test_the_default_limits_take_search_r1_s_grpo_batch(bm25_dir):
    """Search-R1's GRPO recipe: 512 prompts x 5 samples = 2,560 queries in one request, at topk 3."""
    queries = ["capital france", "wine", "sushi capital", "zebra", "berlin"] * 512
    with serve_index(bm25_dir) as url:
        alone = {q: httpx.post(f"{url}/retrieve", json={"queries": [q]}).json()["result"][0] for q in set(queries)}
        response = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 3}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["result"] == [alone[q] for q in queries]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"queries": [], "topk": 3}, 200),
        ({"queries": ["x"], "topk": -1}, 422),
        ({"queries": ["x"], "topk": 1001}, 422),
        ({"queries": "capital", "topk": 3}, 422),
        ({"topk": 3}, 422),
        ({"queries": ["x" * 51]}, 422),
        ({"queries": ["x"] * 6}, 413),
        ({"queries": ["x", "y", "z"], "topk": 5}, 413),  # 15 results: over max_results (12)
        ({"queries": ["capital " * 300]}, 413),
    ],
)
def test_bad_input(bm25_url, body, status):
    response = httpx.post(f"{bm25_url}/retrieve", json=body)
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json() == {"result": []}
    else:
        assert response.json()["detail"]


def test_malformed_json_and_streamed_oversized_body(bm25_url):
    assert httpx.post(f"{bm25_url}/retrieve", content=b"{not json").status_code == 422
    chunks = (b'{"queries": ["' + b"a" * 500 for _ in range(10))  # no content-length: counted as it streams
    assert httpx.post(f"{bm25_url}/retrieve", content=chunks).status_code == 413


def test_health_reports_size_encoder_and_limits(bm25_url):
    health = httpx.get(f"{bm25_url}/health").json()
    assert (health["status"], health["index_type"], health["size"], health["encoder"]) == ("ok", "bm25", 5, "bm25")
    assert health["limits"] == {"default_topk": 3, "max_topk": 1000, "max_queries": 5, "max_results": 12,
                                "max_query_chars": 50, "max_body_bytes": 2000}


async def _fire(url: str, queries: list[str], topk: int) -> list[list[dict]]:
    async with httpx.AsyncClient(timeout=30) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}/retrieve", json={"queries": [q], "topk": topk, "return_scores": True}) for q in queries)
        )
    return [r.json()["result"][0] for r in responses]


def test_concurrent_requests_get_their_own_results(bm25_url):
    queries = ["capital france", "wine", "sushi capital", "france cheese grapes", "berlin", "zebra"] * 8
    alone = {q: httpx.post(f"{bm25_url}/retrieve", json={"queries": [q], "topk": 3, "return_scores": True}).json()["result"][0] for q in set(queries)}
    together = asyncio.run(_fire(bm25_url, queries, 3))
    assert together == [alone[q] for q in queries]


def test_batcher_merges_waiting_requests_into_one_search():
    calls: list[tuple[list[str], int]] = []
    started, release = threading.Event(), threading.Event()

    def search(queries: list[str], k: int):
        calls.append((queries, k))
        if len(calls) == 1:
            started.set()
            release.wait(30)
        rows = np.array([[int(q) * 10 + c for c in range(k)] for q in queries])
        return -rows.astype(np.float32), rows

    async def scenario():
        batcher = DynamicBatcher(search, lambda rows: [{"row": r} for r in rows], max_wait_ms=0.0)
        await batcher.start()
        first = asyncio.create_task(batcher.retrieve(["1"], 1))
        await asyncio.to_thread(started.wait, 30)  # the worker is busy with the first request
        waiting = [asyncio.create_task(batcher.retrieve([str(i)], k)) for i, k in ((2, 2), (3, 3), (4, 2))]
        deadline = time.monotonic() + 30
        while batcher.waiting < 3:  # readiness: all three are queued behind the busy worker
            assert time.monotonic() < deadline, f"only {batcher.waiting} of 3 requests queued"
            await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(first, *waiting)
        await batcher.stop()
        return results, batcher.stats

    results, stats = asyncio.run(scenario())
    # one search per topk among the three (a larger k can order ties differently, so none borrows another's)
    assert calls == [(["1"], 1), (["2", "4"], 2), (["3"], 3)]
    assert [[[d["row"] for d, _ in q] for q in r] for r in results] == [[[10]], [[20, 21]], [[30, 31, 32]], [[40, 41]]]
    assert (stats.batches, stats.requests, stats.largest_batch) == (2, 4, 3)


def test_split_hits_drops_missing_rows_and_trims_to_each_topk():
    rows = np.array([[5, 6, -1], [7, -1, -1], [8, 9, 4]])
    scores = np.array([[0.9, 0.8, 0.0], [0.7, 0.0, 0.0], [0.6, 0.5, 0.4]], dtype=np.float32)
    out = split_hits(scores, rows, ks=[3, 2], counts=[2, 1], fetch=lambda rs: [{"r": r} for r in rs])
    assert out == [
        [[({"r": 5}, pytest.approx(0.9)), ({"r": 6}, pytest.approx(0.8))], [({"r": 7}, pytest.approx(0.7))]],
        [[({"r": 8}, pytest.approx(0.6)), ({"r": 9}, pytest.approx(0.5))]],
    ]


def test_minilm_flat_end_to_end_exact(tmp_path):
    """The embedded MiniLM over HTTP: hand-checked top hits, and every score equal to the cosine computed
    independently with transformers."""
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    manifest = build_index(corpus, tmp_path / "idx", "flat", encoder=DEFAULT_ENCODER)
    assert (manifest.dimension, manifest.encoder.name) == (384, DEFAULT_ENCODER)
    queries = ["Who wrote Hamlet?", "What is the capital of France?", "highest mountain in the world", "which ship hit an iceberg"]
    with serve_index(tmp_path / "idx") as url:
        health = httpx.get(f"{url}/health").json()
        body = {"queries": queries, "topk": len(HAND_CORPUS), "return_scores": True}
        result = httpx.post(f"{url}/retrieve", json=body).json()["result"]
    assert (health["size"], health["encoder"], health["dimension"]) == (8, DEFAULT_ENCODER, 384)
    assert [hits[0]["document"]["id"] for hits in result] == ["hamlet", "paris", "everest", "titanic"]
    model = resolve_model_dir(DEFAULT_ENCODER)
    expected = reference_embeddings(model, queries) @ reference_embeddings(model, [d["contents"] for d in HAND_CORPUS]).T
    ids = [d["id"] for d in HAND_CORPUS]
    for hits, row in zip(result, expected, strict=True):
        assert [h["document"]["id"] for h in hits] == [ids[i] for i in np.argsort(-row, kind="stable")]
        np.testing.assert_allclose([h["score"] for h in hits], np.sort(row)[::-1], atol=1e-4)


def test_minilm_bfloat16_queries_against_a_float32_index(tmp_path):
    """Queries encoded in bf16 (the CPU default where AMX / AVX512-BF16 exist) against passages encoded in
    fp32: the same hand-checked top hits, scores within bf16's precision of the fp32 cosines."""
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "idx", "flat", encoder=DEFAULT_ENCODER)
    queries = ["Who wrote Hamlet?", "What is the capital of France?", "highest mountain in the world", "which ship hit an iceberg"]
    with serve_index(tmp_path / "idx", precision="bfloat16") as url:
        health = httpx.get(f"{url}/health").json()
        result = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 1, "return_scores": True}).json()["result"]
    assert health["encoder_precision"] == "bfloat16"
    assert [hits[0]["document"]["id"] for hits in result] == ["hamlet", "paris", "everest", "titanic"]
    model = resolve_model_dir(DEFAULT_ENCODER)
    expected = (reference_embeddings(model, queries) @ reference_embeddings(model, [d["contents"] for d in HAND_CORPUS]).T).max(1)
    np.testing.assert_allclose([hits[0]["score"] for hits in result], expected, atol=1e-2)


def test_a_request_whose_client_left_is_not_searched(tmp_path):
    from retriever.searcher import open_index
    from retriever.server import create_app
    from tests.test_retriever_support import THREADS, serving

    build_index(write_jsonl(tmp_path / "c.jsonl", BM25_CORPUS), tmp_path / "idx", "bm25")
    opened = open_index(tmp_path / "idx", threads=THREADS)
    entered, release, real_search = threading.Event(), threading.Event(), opened.index.search

    def gated(queries, k):  # the first batch holds the batcher until the test lets it go
        entered.set()
        release.wait(30)
        return real_search(queries, k)

    opened.index.search = gated
    with serving(create_app(opened)) as url:
        first = threading.Thread(target=lambda: httpx.post(url + "/retrieve", json={"queries": ["wine"]}, timeout=60))
        first.start()
        assert entered.wait(30)
        with pytest.raises(httpx.ReadTimeout):  # queued behind the held batch, then gives up
            httpx.post(url + "/retrieve", json={"queries": ["sushi", "paris"]}, timeout=0.5)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").json()["batching"]["abandoned"] < 1:
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.1)  # polling the service's own state: it notices the disconnect on its own time
        release.set()
        first.join(30)
        batching = httpx.get(url + "/health").json()["batching"]
    assert batching["abandoned"] == 1
    assert (batching["requests"], batching["queries"]) == (1, 1)  # only the first request was searched
