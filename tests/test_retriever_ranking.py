"""A query's answer does not depend on its batch-mates, and equal scores come back in corpus order
(retriever/ranking.py, the encoder's batch-invariant mode, faiss_index.py and bm25.py), over loopback HTTP
where it matters: alone, in one request with others, or merged with concurrent requests."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from retriever.encoder import DEFAULT_ENCODER, DenseEncoder, resolve_encoder
from retriever.ranking import top_k
from tests.test_retriever_support import (
    HAND_CORPUS,
    THREADS,
    build_index,
    make_tiny_bert,
    serve_index,
    write_jsonl,
)

# Twenty copies of one passage amid the others: more than faiss's extra candidates (RESCORE_MARGIN).
TWINS = [{"id": f"twin{i}", "contents": '"Wine"\nwine grapes harvest'} for i in range(20)]
TIED_CORPUS = HAND_CORPUS[:3] + TWINS[:10] + HAND_CORPUS[3:] + TWINS[10:]


def test_top_k_keeps_the_first_rows_among_ties():
    scores = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    assert top_k(scores, 3).tolist() == [1, 3, 2]  # 3s by row, then the first of the 2s
    assert top_k(scores, 5).tolist() == [1, 3, 2, 4, 5]
    assert top_k(scores, 9).tolist() == [1, 3, 2, 4, 5, 0, 6]


@pytest.mark.parametrize("index_type", ["bm25", "flat"])
def test_ties_come_back_in_corpus_order(tmp_path, index_type):
    encoder = {} if index_type == "bm25" else {"encoder": str(make_tiny_bert(tmp_path / "tiny-encoder"))}
    build_index(write_jsonl(tmp_path / "c.jsonl", TIED_CORPUS), tmp_path / "idx", index_type, **encoder)
    with serve_index(tmp_path / "idx") as url:
        for k in (3, 12, 25):
            body = {"queries": [TWINS[0]["contents"], "Who wrote Hamlet?"], "topk": k, "return_scores": True}
            hits = httpx.post(f"{url}/retrieve", json=body).json()["result"][0]
            assert [h["document"]["id"] for h in hits[: min(k, 20)]] == [f"twin{i}" for i in range(min(k, 20))]
            assert len({h["score"] for h in hits[:20]}) == 1  # the copies' scores are equal, not merely close


def test_the_query_encoder_is_batch_invariant(tmp_path):
    """bf16 on this CPU, padding to the longest of a batch: the same text got other vectors beside other
    texts. Batch-invariant: bit for bit the same vector alone and amid texts longer, shorter, or of the
    same padded length (a batch needing no padding mask at all)."""
    spec = resolve_encoder(str(make_tiny_bert(tmp_path / "tiny-plain")))
    query = "Who wrote Hamlet?"
    mates = [["capital of France", "a"], ["Mount Everest is the highest mountain on Earth, in the Himalayas. " * 3],
             [query] * 11, ["who wrote hamlet !", "which planet", query, "Jupiter is the largest planet"]]
    for precision in ("bfloat16", "float32"):
        encoder = DenseEncoder(spec, threads=THREADS, precision=precision, batch_invariant=True)
        alone = encoder.encode([query], "query")[0]
        for batch in mates:
            together = encoder.encode(batch + [query], "query")
            assert (together[-1] == alone).all(), (precision, batch)
    exact = DenseEncoder(spec, threads=THREADS, precision="float32").encode([query], "query")[0]
    np.testing.assert_allclose(alone, exact, atol=1e-6)  # the float32 vector, as the build computes it


async def _concurrently(url: str, queries: list[str]) -> list[list[dict]]:
    async with httpx.AsyncClient(timeout=60) as client:
        answers = await asyncio.gather(*(client.post(f"{url}/retrieve", json={"queries": [q], "topk": 5,
                                                                               "return_scores": True})
                                         for q in queries))
    return [a.json()["result"][0] for a in answers]


def test_an_answer_does_not_depend_on_its_batch_mates(tmp_path):
    """The embedded MiniLM served in bf16 (the CPU default where bf16 is native): each query's documents,
    order and scores are the same alone, in one request with the others, and among concurrent requests."""
    corpus = HAND_CORPUS + [{"id": "hamlet2", "contents": '"Hamlet"\nHamlet is a tragedy by William Shakespeare, 1601.'},
                            {"id": "paris2", "contents": '"Paris"\nParis is the capital of France and its largest city.'}]
    build_index(write_jsonl(tmp_path / "c.jsonl", corpus), tmp_path / "idx", "flat", encoder=DEFAULT_ENCODER)
    queries = ["Who wrote Hamlet?", "What is the capital of France?", "hamlet", "largest city of france",
               "highest mountain in the world", "which ship hit an iceberg in the north atlantic in 1912",
               "Shakespeare tragedy", "planet"]
    with serve_index(tmp_path / "idx", precision="bfloat16") as url:
        alone = [httpx.post(f"{url}/retrieve", json={"queries": [q], "topk": 5, "return_scores": True}).json()["result"][0]
                 for q in queries]
        together = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 5, "return_scores": True}).json()["result"]
        merged = asyncio.run(_concurrently(url, queries * 3))
    assert [hits[0]["document"]["id"] for hits in alone[:2]] == ["hamlet", "paris"]
    assert together == alone
    assert merged == alone * 3


def test_ivfpq_probes_the_same_lists_alone_or_batched(tmp_path):
    """An IVF-PQ index of centroid pairs, each query on the bisector of a pair: which centroid of the pair
    is nearer is decided by rounding, and faiss rounds differently alone (a SIMD scan) and in a batch
    (BLAS). The lists probed, and so the hits, must not change with the batch."""
    import faiss

    from retriever.faiss_index import FaissSearch

    rng = np.random.default_rng(0)
    d, pairs = 32, 200
    centroids = rng.standard_normal((2 * pairs, d)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    quantizer = faiss.IndexFlatIP(d)
    quantizer.add(centroids)
    index = faiss.IndexIVFPQ(quantizer, d, 2 * pairs, 8, 4, faiss.METRIC_INNER_PRODUCT)
    passages = np.repeat(centroids, 3, axis=0) + (rng.standard_normal((6 * pairs, d)) * 0.05).astype(np.float32)
    index.train(passages)  # the quantizer is given: this trains the PQ codes
    index.add(passages)  # three passages in each list
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    searcher = FaissSearch(tmp_path / "index.faiss", "ivfpq", {"nprobe": 1}, mmap=False, use_gpu=False)
    queries = centroids[:pairs] + centroids[pairs:]
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    together = searcher.search(queries, 3)
    alone = [searcher.search(q[None], 3) for q in queries]
    assert (together[1] >= 0).all()
    np.testing.assert_array_equal(together[1], np.concatenate([r for _, r in alone]))
    np.testing.assert_array_equal(together[0], np.concatenate([s for s, _ in alone]))
