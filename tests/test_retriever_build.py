"""retriever/build.py: bad corpus lines, atomicity (a killed build leaves no index), resume, the manifest,
and that the package and a BM25 server never import torch."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

from retriever.analyzer import ANALYZER
from retriever.build import STATE_FILE, build, partial_dir
from retriever.build_config import BuildConfig
from retriever.docstore import DOCS_FILE, DocStore
from retriever.errors import RetrieverError
from retriever.manifest import read_manifest
from retriever.reindex import reindex
from tests.test_retriever_support import (
    HAND_CORPUS,
    REPO,
    Killed,
    build_index,
    make_tiny_encoder,
    synthetic_corpus_file,
    wait_for_file,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory)


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "retriever", *args], capture_output=True, text=True, cwd=REPO, **kwargs)


def test_bad_json_line_stops_the_build_naming_the_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps(HAND_CORPUS[0]), json.dumps(HAND_CORPUS[1]), '{"id": "x", "contents": "unterminated']
    corpus.write_text("\n".join(lines) + "\n")
    result = _cli("build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"), "--index", "bm25", "--quiet")
    assert result.returncode == 2
    assert "error: corpus line 3: not valid JSON" in result.stderr
    assert "--skip-bad" in result.stderr
    assert not (tmp_path / "idx").exists()


def test_bm25_needs_no_faiss_and_a_dense_build_without_it_names_the_extra(tmp_path, tiny_encoder):
    """faiss is an extra (faiss-cpu, or faiss-gpu with `gpu`): without it a BM25 index builds, and a dense
    build stops with the install command before it encodes anything."""
    corpus = write_jsonl(tmp_path / "corpus.jsonl", HAND_CORPUS)
    without_faiss = ("import runpy, sys; sys.modules['faiss'] = None; sys.argv[0] = 'retriever'; "
                     "runpy.run_module('retriever', run_name='__main__')")

    def build_without_faiss(out: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", without_faiss, "build", "--corpus", str(corpus), "--out",
                               str(out), "--quiet", *args], capture_output=True, text=True, cwd=REPO)

    sparse = build_without_faiss(tmp_path / "bm25", "--index", "bm25")
    assert sparse.returncode == 0, sparse.stderr
    assert read_manifest(tmp_path / "bm25").corpus.rows == len(HAND_CORPUS)
    assert read_manifest(tmp_path / "bm25").build["faiss_version"] is None
    dense = build_without_faiss(tmp_path / "flat", "--index", "flat", "--encoder", str(tiny_encoder))
    assert dense.returncode == 2 and "error: dense indexes need faiss" in dense.stderr, dense.stderr
    assert "pip install 'agentrl[faiss-cpu]'" in dense.stderr and "Traceback" not in dense.stderr
    assert not (tmp_path / "flat").exists() and not partial_dir(tmp_path / "flat").exists()  # stopped before encoding


def test_missing_contents_is_named(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", [HAND_CORPUS[0], {"id": "7", "text": "no contents"}])
    with pytest.raises(RetrieverError, match=r"corpus line 2: lacks a `contents` field"):
        build_index(corpus, tmp_path / "idx", "bm25")
    assert not (tmp_path / "idx").exists()


def test_skip_bad_skips_and_counts(tmp_path):
    corpus = tmp_path / "c.jsonl"
    lines = [json.dumps(HAND_CORPUS[0]), "not json", json.dumps({"id": 1}), "", json.dumps(HAND_CORPUS[1]), "[1, 2]"]
    corpus.write_text("\n".join(lines) + "\n")
    manifest = build_index(corpus, tmp_path / "idx", "bm25", skip_bad=True)
    assert manifest.corpus.rows == 2
    assert manifest.corpus.skipped_lines == 3  # the blank line is not a passage, and not an error
    assert [e.split(":")[0] for e in manifest.build["first_skipped"]] == ["corpus line 2", "corpus line 3", "corpus line 6"]
    docs = DocStore(tmp_path / "idx")
    assert docs.get_many([0, 1]) == [HAND_CORPUS[0], HAND_CORPUS[1]]


def test_a_lone_surrogate_is_a_bad_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(HAND_CORPUS[0]) + "\n" + '{"id": 9, "contents": "bad \\ud800 text"}\n')
    with pytest.raises(RetrieverError, match="corpus line 2: a lone UTF-16 surrogate"):
        build_index(corpus, tmp_path / "idx", "bm25")
    assert build_index(corpus, tmp_path / "idx2", "bm25", skip_bad=True).corpus.skipped_lines == 1


@pytest.mark.parametrize(("line", "why"), [('{"id": 1e400, "contents": "x"}', "1e400 overflows"),
                                          ('{"id": NaN, "contents": "x"}', "NaN is not a JSON number")])
def test_a_non_finite_number_is_a_bad_line(tmp_path, line, why):
    """Python's json reads these, but no JSON answer could carry them back: every query hitting the
    passage would fail at serve time."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps(HAND_CORPUS[0]) + "\n" + line + "\n")
    with pytest.raises(RetrieverError, match=f"corpus line 2: {why}"):
        build_index(corpus, tmp_path / "idx", "bm25")
    assert build_index(corpus, tmp_path / "idx2", "bm25", skip_bad=True).corpus.skipped_lines == 1


def test_manifest_records_corpus_and_encoder(tmp_path, tiny_encoder):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "idx", "flat", encoder=str(tiny_encoder), shard_size=3)
    m = read_manifest(tmp_path / "idx")
    assert (m.index_type, m.dimension, m.corpus.rows) == ("flat", 32, len(HAND_CORPUS))
    assert m.corpus.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert m.corpus.bytes == corpus.stat().st_size
    assert m.encoder is not None and (m.encoder.pooling, m.encoder.query_prefix, m.encoder.dimension) == ("mean", "", 32)
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == ["docs.jsonl", "docs.offsets.bin", "index.faiss", "manifest.json"]
    assert not partial_dir(tmp_path / "idx").exists()


def test_existing_output_needs_overwrite(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "idx", "bm25")
    with pytest.raises(RetrieverError, match="already exists; pass --overwrite"):
        build_index(corpus, tmp_path / "idx", "bm25")
    write_jsonl(corpus, HAND_CORPUS[:3])
    assert build_index(corpus, tmp_path / "idx", "bm25", overwrite=True).corpus.rows == 3


@pytest.mark.parametrize("point", ["after dropping the shards", "after dropping the state", "with the old index aside"])
def test_a_build_killed_while_finishing_resumes(tmp_path, monkeypatch, point):
    import retriever.build as build_module

    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    if point == "with the old index aside":
        build_index(write_jsonl(tmp_path / "old.jsonl", HAND_CORPUS[:2]), out, "bm25")
    real_rmtree, real_unlink, real_rename = build_module.shutil.rmtree, Path.unlink, Path.rename

    def rmtree(path, *a, **k):
        real_rmtree(path, *a, **k)
        if point == "after dropping the shards" and Path(path).name == "tokens":
            raise Killed

    def unlink(self, *a, **k):
        real_unlink(self, *a, **k)
        if point == "after dropping the state" and self.name == STATE_FILE:
            raise Killed

    def rename(self, target):
        done = real_rename(self, target)
        if point == "with the old index aside" and ".old-" in Path(target).name:
            raise Killed
        return done

    with monkeypatch.context() as m:
        m.setattr(build_module.shutil, "rmtree", rmtree)
        m.setattr(Path, "unlink", unlink)
        m.setattr(Path, "rename", rename)
        with pytest.raises(Killed):
            build_index(corpus, out, "bm25", overwrite=True)
    assert not out.exists()
    manifest = build_index(corpus, out, "bm25", overwrite=True)  # the same command again
    assert manifest.corpus.rows == len(HAND_CORPUS) and read_manifest(out).corpus.rows == len(HAND_CORPUS)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != ".idx.lock")  # the build lock stays (outdir.py)
    assert left == ["c.jsonl", "idx"] + (["old.jsonl"] if "old" in point else [])
    assert not (out / STATE_FILE).exists() and not (out / "tokens").exists()


def _vectors(index_dir: Path) -> np.ndarray:
    index = faiss.read_index(str(index_dir / "index.faiss"))
    return index.reconstruct_n(0, index.ntotal)


@pytest.mark.parametrize("index_type", ["flat", "bm25"])
def test_killed_build_leaves_no_index_and_resumes(tmp_path, tiny_encoder, index_type, capsys):
    corpus, _ = synthetic_corpus_file(tmp_path / "corpus.jsonl", 100)
    lines = corpus.read_bytes().splitlines(keepends=True)
    out = tmp_path / "idx"
    settings = {"encoder": str(tiny_encoder), "shard_size": 20, "precision": "float32"}
    # The first build reads a pipe that we fill with 50 lines and never close: it commits two shards of 20,
    # then waits for more input, and is killed there.
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "retriever", "build", "--corpus", str(fifo), "--out", str(out), "--index", index_type,
         "--encoder", settings["encoder"], "--shard-size", "20", "--threads", "1", "--quiet",
         "--precision", "float32"],
        cwd=REPO, stderr=subprocess.PIPE,
    )  # fmt: skip
    with open(fifo, "wb") as writer:
        writer.write(b"".join(lines[:50]))
        writer.flush()
        state_file = partial_dir(out) / STATE_FILE
        wait_for_file(state_file, lambda: json.loads(state_file.read_text())["shards"] == 2, proc)
        proc.kill()
        proc.wait()
    assert not out.exists(), "a killed build must not leave an index directory"
    state = json.loads(state_file.read_text())
    assert (state["rows"], state["encoded"]) == (40, False)

    if index_type == "flat":  # the shards were encoded in float32: resuming in another precision is refused
        with pytest.raises(RetrieverError, match="precision: 'float32' -> 'bfloat16'"):
            build(BuildConfig(corpus=corpus, out=out, index_type=index_type, threads=1,
                              **(settings | {"precision": "bfloat16"})))
    manifest = build(BuildConfig(corpus=corpus, out=out, index_type=index_type, progress=True, threads=1, **settings))
    assert "40 passages in 2 shards already done" in capsys.readouterr().err
    assert manifest.corpus.rows == 100
    assert manifest.corpus.sha256 == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert not partial_dir(out).exists()

    fresh = tmp_path / "fresh"
    build_index(corpus, fresh, index_type, **settings)
    assert (out / DOCS_FILE).read_bytes() == (fresh / DOCS_FILE).read_bytes()
    if index_type == "flat":
        np.testing.assert_allclose(_vectors(out), _vectors(fresh), atol=1e-6)
    else:
        for name in ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy"):
            assert np.array_equal(np.load(out / "bm25" / name), np.load(fresh / "bm25" / name))


def test_resume_refuses_other_settings_until_restart(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    work = partial_dir(out)
    work.mkdir()
    (work / STATE_FILE).write_text(json.dumps({"params": {"kind": "bm25", "analyzer": ANALYZER, "shard_size": 99,
                                                                "max_passage_chars": 16384}, "rows": 0}))
    with pytest.raises(RetrieverError, match=r"other settings \(shard_size: 99 -> 16384\).*--restart"):
        build_index(corpus, out, "bm25")
    assert build_index(corpus, out, "bm25", restart=True).corpus.rows == len(HAND_CORPUS)


def test_resume_refuses_a_changed_corpus(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    first = (json.dumps(HAND_CORPUS[0]) + "\n").encode()
    state = {"params": {"kind": "bm25", "analyzer": ANALYZER, "shard_size": 16384, "max_passage_chars": 16384},
             "corpus_offset": len(first),
             "corpus_line": 1, "corpus_row": 1, "prefix_sha256": hashlib.sha256(b"x" * len(first)).hexdigest()}  # fmt: skip
    partial_dir(out).mkdir()
    (partial_dir(out) / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(RetrieverError, match=r"first \d+ bytes of the corpus differ.*pass --restart"):
        build_index(corpus, out, "bm25")


def test_importing_the_package_and_serving_bm25_never_import_torch(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "idx", "bm25")
    code = (
        "import sys, retriever, retriever.cli, retriever.server, retriever.build, retriever.encoder\n"
        "from pathlib import Path\n"
        "from retriever.searcher import open_index\n"
        "from retriever.server import create_app\n"
        f"opened = open_index(Path({str(tmp_path / 'idx')!r}))\n"
        "create_app(opened)\n"
        "scores, rows = opened.index.search(['capital of France'], 3)\n"
        "assert opened.docs.get(int(rows[0, 0]))['id'] == 'paris', rows\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_ivfpq_on_too_small_a_corpus_is_a_clear_error(tmp_path, tiny_encoder):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    with pytest.raises(RetrieverError, match=r"IVF-PQ .* needs at least 16 passages to train; the corpus has 8"):
        build_index(corpus, tmp_path / "idx", "ivfpq", encoder=str(tiny_encoder))
    assert not (tmp_path / "idx").exists()


def test_kept_embeddings_reindex_to_the_same_vectors(tmp_path, tiny_encoder):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    build_index(corpus, tmp_path / "hnsw", "hnsw", encoder=str(tiny_encoder), shard_size=3, keep_embeddings=True)
    kept = np.concatenate([np.load(p) for p in sorted((tmp_path / "hnsw" / "embeddings").glob("*.npy"))])
    manifest = reindex(tmp_path / "hnsw", tmp_path / "flat", "flat", {}, threads=1)
    assert (manifest.index_type, manifest.corpus.rows, manifest.build["reindexed_from"]) == ("flat", 8, str(tmp_path / "hnsw"))
    np.testing.assert_array_equal(_vectors(tmp_path / "flat"), kept)
    assert DocStore(tmp_path / "flat").get_many(list(range(8))) == HAND_CORPUS


def test_gpu_probe_names_why_faiss_cannot_use_gpus():
    """A faiss-gpu build without kernels for the GPUs aborts the process rather than raising, so the GPU
    path is probed in a child process, whose failure is reported by its error line. With faiss-cpu the
    child fails at the GPU cloner (on the GPU machine, tests/gpu/test_retriever_gpu.py covers the rest)."""
    from retriever import faiss_index

    if hasattr(faiss, "StandardGpuResources"):
        pytest.skip("this faiss has GPU support: tests/gpu covers it")
    usable, reason = faiss_index.probe_gpu_kernels.__wrapped__()
    assert not usable
    assert reason == "AttributeError: module 'faiss' has no attribute 'GpuMultipleClonerOptions'"
    assert faiss_index.gpu_count() == 0
