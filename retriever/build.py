"""`retriever build`: a corpus in, a complete index directory out, or nothing.

Everything is written into `OUT.partial/` beside OUT and renamed to OUT when complete, so OUT never exists
half-built. ingest.py streams the corpus into shards and commits the build state after each one, so a
killed build rerun with the same command continues after the last committed shard (its settings and the
corpus prefix must match; `--restart` discards it). A build whose corpus yields no passage keeps nothing,
so the fixed corpus builds from scratch. Then the index is built from the shards (faiss_index.py or
bm25.py) and `manifest.json` (manifest.py) is written last, with the counts of skipped lines, passages cut
to the size cap, empty contents and duplicate ids, which the build also reports. A build interrupted
after its manifest checks that the corpus is still the one it read before it publishes. Memory stays
bounded by a shard plus the index itself. reindex.py rebuilds another dense index type from a finished
directory without re-encoding.

Builds into one OUT are exclusive: each holds outdir.build_lock(OUT) from before it looks at OUT or
OUT.partial until it has published, and a second one stops at once naming the first. `--overwrite`
replaces only an index directory (outdir.check_replaceable), checked before the corpus is read and again
before the old index is set aside.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from retriever import bm25
from retriever.analyzer import ANALYZER
from retriever.build_config import BuildConfig
from retriever.corpus import sha256_of
from retriever.encoder import EncoderSpec, resolve_encoder
from retriever.errors import RetrieverError
from retriever.ingest import (
    EMBEDDINGS_DIR,
    IDS_DIR,
    SHARDS_DIR,
    STATE_FILE,
    TOKENS_DIR,
    VOCAB_LOG,
    BuildState,
    atomic_write_json,
    count_duplicate_ids,
    ingest_corpus,
    load_vocab,
    shard_reader,
    shard_sampler,
)
from retriever.manifest import (
    DENSE_TYPES,
    MANIFEST_FILE,
    Bm25Info,
    CorpusInfo,
    EncoderInfo,
    Manifest,
    partial_dir,
    read_manifest,
    write_manifest,
)
from retriever.outdir import build_lock, check_replaceable


def _log(cfg: BuildConfig, message: str) -> None:
    if cfg.progress:
        print(message, file=sys.stderr, flush=True)


def _content_params(cfg: BuildConfig, spec: EncoderSpec | None) -> dict[str, Any]:
    """What the shards depend on: a partial build resumes only under the same values."""
    if spec is None:
        return {"kind": "bm25", "analyzer": ANALYZER, "shard_size": cfg.shard_size,
                "max_passage_chars": cfg.max_passage_chars}
    from retriever.encoder import on_gpu, resolve_precision

    return {
        "kind": "dense", "encoder": spec.name, "fingerprint": spec.fingerprint, "pooling": spec.pooling,
        "query_prefix": spec.query_prefix, "passage_prefix": spec.passage_prefix,
        "max_length": spec.max_length, "shard_size": cfg.shard_size, "max_passage_chars": cfg.max_passage_chars,
        "precision": resolve_precision(cfg.precision, on_gpu(cfg.device)),
    }  # fmt: skip


def _open_state(cfg: BuildConfig, work: Path, params: dict[str, Any]) -> BuildState:
    if cfg.restart and work.exists():
        shutil.rmtree(work)
    if (work / STATE_FILE).exists():
        try:
            state = BuildState(**json.loads((work / STATE_FILE).read_text()))
        except (TypeError, ValueError):  # unreadable, or written by a version with other state fields
            raise RetrieverError(f"{work / STATE_FILE} is not a build state this version reads; "
                                 "pass --restart to build from the start") from None
        if state.params != params:
            diff = ", ".join(f"{k}: {state.params.get(k)!r} -> {v!r}" for k, v in params.items() if state.params.get(k) != v)
            raise RetrieverError(
                f"{work} holds an interrupted build with other settings ({diff}); "
                "run the same command to resume it, or pass --restart to discard it"
            )
        _log(cfg, f"resuming {work}: {state.rows} passages in {state.shards} shards already done")
        return state
    if (work / MANIFEST_FILE).exists():  # killed after the clean-up, before the rename: complete
        return BuildState(params=params, finished=True)
    if work.exists():
        shutil.rmtree(work)  # a partial build killed before its first commit holds nothing to keep
    work.mkdir(parents=True)
    return BuildState(params=params)


def build(cfg: BuildConfig) -> Manifest:
    """Build the index `cfg` describes into `cfg.out` (see the module docstring for the guarantees)."""
    if cfg.index_type not in (*DENSE_TYPES, "bm25"):
        raise RetrieverError(f"--index {cfg.index_type!r}: expected flat, hnsw, ivfpq or bm25")
    if not cfg.corpus.exists():
        raise RetrieverError(f"corpus {cfg.corpus}: no such file")
    if cfg.shard_size < 1:
        raise RetrieverError("--shard-size must be at least 1")
    if cfg.max_passage_chars < 1:
        raise RetrieverError(f"--max-passage-chars must be at least 1, got {cfg.max_passage_chars}")
    # Held before anything in OUT or OUT.partial is looked at: another build of the same OUT stops here,
    # before its --restart or --overwrite could delete what the running one writes.
    with build_lock(cfg.out):
        if cfg.out.exists():
            if not cfg.overwrite:
                raise RetrieverError(f"{cfg.out} already exists; pass --overwrite to replace it")
            check_replaceable(cfg.out, cfg.corpus)  # refused before the corpus is read, not after
        return _build_locked(cfg)


def _build_locked(cfg: BuildConfig) -> Manifest:
    dense = cfg.index_type in DENSE_TYPES
    if dense:  # faiss is an extra: without it the build stops here, not after hours of encoding
        import retriever.faiss_index  # noqa: F401
    spec = (
        resolve_encoder(
            cfg.encoder, pooling=cfg.pooling, prefix_style=cfg.prefix_style, query_prefix=cfg.query_prefix,
            passage_prefix=cfg.passage_prefix, max_length=cfg.max_length,
        )
        if dense else None
    )  # fmt: skip
    work = partial_dir(cfg.out)
    state = _open_state(cfg, work, _content_params(cfg, spec))
    if state.finished:  # interrupted after the index was complete: only the clean-up and the rename are left
        manifest = read_manifest(work)
        _check_corpus_unchanged(cfg.corpus, manifest.corpus, work)
        _finish(cfg, work, manifest, state)
        return manifest
    started = time.time()
    ingest_corpus(cfg, spec, work, state, lambda message: _log(cfg, message))
    if state.rows == 0:
        shutil.rmtree(work)  # nothing worth resuming: the next run starts afresh
        raise RetrieverError(f"corpus {cfg.corpus}: no passages (only blank or skipped lines); nothing was kept: "
                             "fix the corpus and run the command again")
    duplicates, first_duplicates = count_duplicate_ids(work, state.shards)
    index_started = time.time()
    if spec is not None:
        dimension, index_params = _index_dense(cfg, work, state)
    else:
        dimension, index_params = None, _index_bm25(cfg, work, state)
    manifest = Manifest(
        index_type=cfg.index_type,  # type: ignore[arg-type]
        dimension=dimension,
        encoder=EncoderInfo(
            name=spec.name, fingerprint=spec.fingerprint, pooling=spec.pooling, query_prefix=spec.query_prefix,
            passage_prefix=spec.passage_prefix, max_length=spec.max_length, dimension=dimension,
        ) if spec is not None and dimension is not None else None,
        bm25=None if dense else Bm25Info(k1=cfg.k1, b=cfg.b, method=bm25.DEFAULT_METHOD, analyzer=ANALYZER),
        corpus=CorpusInfo(
            source=str(cfg.corpus), rows=state.rows, bytes=state.corpus_offset, sha256=state.prefix_sha256 or "",
            skipped_lines=state.counts.get("skipped", 0), max_passage_chars=cfg.max_passage_chars,
            truncated=state.counts.get("truncated", 0), empty_contents=state.counts.get("empty", 0),
            duplicate_ids=duplicates,
        ),
        index_params=index_params,
        build=_build_info(state, index_seconds=time.time() - index_started, total_seconds=time.time() - started,
                          dense=dense) | {"first_duplicate_ids": first_duplicates},
    )  # fmt: skip
    _finish(cfg, work, manifest, state)
    return manifest


def _build_info(state: BuildState, index_seconds: float, total_seconds: float, dense: bool) -> dict[str, Any]:
    faiss_version = None
    if dense:
        from retriever.faiss_index import faiss

        faiss_version = faiss.__version__
    rate = state.rows / state.encode_seconds if state.encode_seconds else None
    return {
        "encode_seconds": round(state.encode_seconds, 3), "index_seconds": round(index_seconds, 3),
        "passages_per_second": round(rate, 1) if rate else None, "seconds_this_run": round(total_seconds, 3),
        "faiss_version": faiss_version, "first_skipped": state.examples.get("skipped", []),
        "first_truncated": state.examples.get("truncated", []), "first_empty": state.examples.get("empty", []),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip


def _index_dense(cfg: BuildConfig, work: Path, state: BuildState) -> tuple[int, dict[str, Any]]:
    from retriever.faiss_index import INDEX_FILE, build_faiss, resolve_params, set_threads, write_faiss

    set_threads(cfg.threads)
    shards = work / SHARDS_DIR
    dim = int(np.load(shards / "00000.npy", mmap_mode="r").shape[1])
    params = resolve_params(cfg.index_type, state.rows, dim, cfg.index_params)
    _log(cfg, f"building {cfg.index_type} index over {state.rows} vectors of {dim} dims ({params})")
    index = build_faiss(
        cfg.index_type, dim, params, shard_reader(shards, state.shards),
        shard_sampler(shards, state.shards, state.rows), cfg.use_gpu,
    )  # fmt: skip
    write_faiss(index, work / INDEX_FILE)
    return dim, params


def _index_bm25(cfg: BuildConfig, work: Path, state: BuildState) -> dict[str, Any]:
    out = work / bm25.BM25_DIR
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    tokenizer = bm25.new_tokenizer(word_to_id=load_vocab(work / VOCAB_LOG, state.vocab_terms, state.vocab_bytes))
    _log(cfg, f"building bm25 index over {state.rows} passages ({len(tokenizer.word_to_id)} terms)")
    bm25.build_bm25(work / TOKENS_DIR, state.shards, state.rows, tokenizer, out, cfg.k1, cfg.b, bm25.DEFAULT_METHOD)
    return {"k1": cfg.k1, "b": cfg.b, "terms": len(tokenizer.word_to_id)}


def _finish(cfg: BuildConfig, work: Path, manifest: Manifest, state: BuildState) -> None:
    """Write the manifest, mark the state finished, drop the build's scaffolding (the state last) and
    rename the directory into place. A rerun after a kill anywhere in here resumes from the mark: it never
    meets a state that promises shards already deleted."""
    if not state.finished:
        write_manifest(work, manifest)
        state.finished = True
        atomic_write_json(work / STATE_FILE, asdict(state))
    if cfg.keep_embeddings and (work / SHARDS_DIR).exists():
        (work / SHARDS_DIR).rename(work / EMBEDDINGS_DIR)
    for leftover in (SHARDS_DIR, TOKENS_DIR, IDS_DIR):
        if (work / leftover).exists():
            shutil.rmtree(work / leftover)
    for leftover in (VOCAB_LOG, STATE_FILE):
        (work / leftover).unlink(missing_ok=True)
    publish(work, cfg.out, cfg.overwrite)
    _log(cfg, f"wrote {cfg.out}: {manifest.index_type}, {manifest.corpus.rows} passages{corpus_notes(manifest)}")


def corpus_notes(manifest: Manifest) -> str:
    """What the build noticed about the rows, for its last line: "; 2 duplicate ids (first: "7"), ..."."""
    c, b = manifest.corpus, manifest.build
    notes = [
        (c.skipped_lines, "bad lines skipped", b.get("first_skipped", [])),
        (c.truncated, f"passages cut to {c.max_passage_chars} characters", b.get("first_truncated", [])),
        (c.empty_contents, "passages with empty contents", b.get("first_empty", [])),
        (c.duplicate_ids, "passages repeating an earlier id", b.get("first_duplicate_ids", [])),
    ]
    return "".join(f"; {n} {what} (first: {first[0]})" if first else f"; {n} {what}" for n, what, first in notes if n)


def _check_corpus_unchanged(corpus: Path, built: CorpusInfo, work: Path) -> None:
    """Before publishing a build interrupted after its manifest: the corpus must still be the one it read
    (size, then hash), or rows appended since would be silently left out."""
    if not corpus.is_file():
        return  # a pipe cannot be read twice: what was read is what was built
    size = corpus.stat().st_size
    if size != built.bytes or sha256_of(corpus) != built.sha256:
        raise RetrieverError(
            f"{work} holds a finished build of {built.bytes} bytes of {corpus}, which has changed since "
            f"({size} bytes now); pass --restart to build it from the start"
        )


def publish(work: Path, out: Path, overwrite: bool) -> None:
    """Rename a finished `work` directory to `out` (replacing an old `out` only when asked, and only an index
    directory: outdir.check_replaceable). The caller holds outdir.build_lock(out)."""
    for stale in out.parent.glob(f".{out.name}.old-*"):  # an old index a killed --overwrite left aside
        shutil.rmtree(stale, ignore_errors=True)
    old = None
    if out.exists():
        if not overwrite:
            raise RetrieverError(f"{out} already exists; pass --overwrite to replace it")
        check_replaceable(out)  # checked again: files may have been put there while the build ran
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
    os.rename(work, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable once the parent directory is synced
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old)
