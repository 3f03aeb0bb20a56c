"""What a build does with the corpus's rows (retriever/corpus.py, ingest.py, build.py): every field kept and
served, the per-passage size cap, duplicate ids and empty contents counted and reported; a failed build
never poisons the next, and a build interrupted after reading its corpus reads it again before finishing."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from retriever.build import STATE_FILE, partial_dir
from retriever.docstore import DOCS_FILE, DocStore
from retriever.errors import RetrieverError
from retriever.ingest import sample_rows, shard_sampler
from tests.test_retriever_support import (
    HAND_CORPUS,
    Killed,
    build_index,
    make_tiny_encoder,
    reference_embeddings,
    serve_index,
    synthetic_corpus_file,
    write_jsonl,
)


def test_documents_carry_every_field_of_the_row(tmp_path):
    rows = [
        {"id": "h", "title": "Hamlet", "text": "a tragedy", "contents": '"Hamlet"\na tragedy', "year": 1600},
        {"contents": '"Paris"\ncapital of France', "title": "Paris"},  # no id: the row number, first
    ]
    build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "idx", "bm25")
    with serve_index(tmp_path / "idx") as url:
        body = {"queries": ["tragedy", "capital"], "topk": 1, "return_scores": True}
        result = httpx.post(f"{url}/retrieve", json=body).json()["result"]
    assert [hits[0]["document"] for hits in result] == [rows[0], {"id": "1", **rows[1]}]
    assert list(result[1][0]["document"]) == ["id", "contents", "title"]


def test_a_passage_over_the_cap_is_cut_encoded_as_cut_counted_and_reported(tmp_path_factory, tmp_path, capsys):
    """A huge line (60 kB here, with a cap of 100 characters: under the line bound of 64 bytes a character
    plus 64 KiB, corpus.max_line_bytes) is served and encoded cut to the cap, each of its string fields; the
    rows under the cap are kept whole."""
    tiny_encoder = make_tiny_encoder(tmp_path_factory)
    huge = {"id": "huge", "contents": '"Paris"\nParis is the capital and largest city of France. ' * 1_000,
            "text": "x" * 150}
    corpus = write_jsonl(tmp_path / "c.jsonl", [HAND_CORPUS[0], huge, HAND_CORPUS[2]])
    manifest = build_index(corpus, tmp_path / "idx", "flat", encoder=str(tiny_encoder), max_passage_chars=100,
                           progress=True)
    assert (manifest.corpus.truncated, manifest.corpus.max_passage_chars) == (1, 100)
    assert manifest.build["first_truncated"] == ["corpus line 2"]
    assert "1 passages cut to 100 characters (first: corpus line 2)" in capsys.readouterr().err
    cut = huge["contents"][:100]
    docs = DocStore(tmp_path / "idx")
    assert docs.get_many([0, 1, 2]) == [HAND_CORPUS[0], {"id": "huge", "contents": cut, "text": "x" * 100}, HAND_CORPUS[2]]
    query = "capital of France"
    with serve_index(tmp_path / "idx") as url:
        hits = httpx.post(f"{url}/retrieve", json={"queries": [query], "topk": 3, "return_scores": True}).json()["result"][0]
    score = {h["document"]["id"]: h["score"] for h in hits}["huge"]
    expected = reference_embeddings(tiny_encoder, [cut]) @ reference_embeddings(tiny_encoder, [query])[0]
    np.testing.assert_allclose(score, expected[0], atol=1e-5)


def test_duplicate_ids_and_empty_contents_are_counted_and_reported(tmp_path, capsys):
    rows = [{"id": "a", "contents": "one"}, {"id": "b", "contents": ""}, {"id": "a", "contents": "two"},
            {"id": 7, "contents": "three"}, {"id": "7", "contents": " \n "}, {"id": "b", "contents": "four"},
            {"id": "a", "contents": "five"}]  # fmt: skip
    manifest = build_index(write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "idx", "bm25", shard_size=2,
                           progress=True)
    assert manifest.corpus.duplicate_ids == 3  # rows 3, 6 and 7 repeat "a", "b", "a"; 7 and "7" differ
    assert manifest.build["first_duplicate_ids"] == ['"a"', '"b"']
    assert manifest.corpus.empty_contents == 2
    assert manifest.build["first_empty"] == ["corpus line 2", "corpus line 5"]
    err = capsys.readouterr().err
    assert '2 passages with empty contents (first: corpus line 2); 3 passages repeating an earlier id (first: "a")' in err
    assert manifest.corpus.rows == 7  # counted, still indexed and served


def test_an_empty_corpus_does_not_poison_the_next_build(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n\n")
    with pytest.raises(RetrieverError, match=r"no passages .*nothing was kept: fix the corpus and run the command again"):
        build_index(corpus, tmp_path / "idx", "bm25")
    assert not partial_dir(tmp_path / "idx").exists()
    write_jsonl(corpus, HAND_CORPUS)
    assert build_index(corpus, tmp_path / "idx", "bm25").corpus.rows == len(HAND_CORPUS)


def test_rows_appended_after_a_build_read_its_corpus_are_not_left_out(tmp_path_factory, tmp_path):
    """IVF-PQ refuses 8 passages after reading and encoding them (the state says the corpus was read).
    Rows appended since are then read by the next build, which continues after the committed shards;
    a corpus changed before them is refused, with how to restart."""
    tiny_encoder = make_tiny_encoder(tmp_path_factory)
    path, _ = synthetic_corpus_file(tmp_path / "full.jsonl", 40)
    lines = path.read_bytes().splitlines(keepends=True)
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(b"".join(lines[:8]))
    out, settings = tmp_path / "idx", {"encoder": str(tiny_encoder), "shard_size": 5}
    with pytest.raises(RetrieverError, match="needs at least 16 passages"):
        build_index(corpus, out, "ivfpq", **settings)
    assert json.loads((partial_dir(out) / STATE_FILE).read_text())["encoded"] is True
    corpus.write_bytes(b"".join(lines))  # appended
    manifest = build_index(corpus, out, "flat", **settings)
    assert manifest.corpus.rows == 40
    fresh = build_index(path, tmp_path / "fresh", "flat", **settings)
    assert manifest.corpus.sha256 == fresh.corpus.sha256
    assert (out / DOCS_FILE).read_bytes() == (tmp_path / "fresh" / DOCS_FILE).read_bytes()

    corpus.write_bytes(b"".join(lines[:8]))
    with pytest.raises(RetrieverError, match="needs at least 16 passages"):
        build_index(corpus, tmp_path / "idx2", "ivfpq", **settings)
    corpus.write_bytes(b"".join(lines[1:9]))  # changed, not appended
    with pytest.raises(RetrieverError, match=r"first \d+ bytes of the corpus differ.*pass --restart"):
        build_index(corpus, tmp_path / "idx2", "flat", **settings)
    assert build_index(corpus, tmp_path / "idx2", "flat", restart=True, **settings).corpus.rows == 8


def test_a_finished_build_is_not_published_for_a_changed_corpus(tmp_path, monkeypatch):
    import retriever.build as build_module

    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS[:4])
    with monkeypatch.context() as m:
        m.setattr(build_module, "publish", lambda *a: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):  # killed at the rename, after the manifest was written
            build_index(corpus, tmp_path / "idx", "bm25")
    write_jsonl(corpus, HAND_CORPUS)  # four rows appended since
    with pytest.raises(RetrieverError, match=r"has changed since \(\d+ bytes now\); pass --restart"):
        build_index(corpus, tmp_path / "idx", "bm25")
    assert build_index(corpus, tmp_path / "idx", "bm25", restart=True).corpus.rows == len(HAND_CORPUS)


def test_shard_sampler_reads_shards_of_any_size(tmp_path):
    """A build resumed for appended rows has a short shard before full ones: rows 0..12 in 5 + 3 + 5."""
    for i, (lo, hi) in enumerate([(0, 5), (5, 8), (8, 13)]):
        np.save(tmp_path / f"{i:05d}.npy", np.arange(lo, hi, dtype=np.float32)[:, None])
    sample = shard_sampler(tmp_path, 3, 13)
    np.testing.assert_array_equal(sample(9)[:, 0], sample_rows(13, 9))
    np.testing.assert_array_equal(sample(13)[:, 0], np.arange(13))
