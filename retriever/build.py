"""`retriever build`: a corpus in, a complete index directory out, or nothing.

Everything is written into `OUT.partial/` beside OUT and renamed to OUT when complete, so OUT never exists
half-built. The corpus is streamed once, in shards of `shard_size` passages: each shard's embeddings
(`shards/NNNNN.npy`) or BM25 token ids (`tokens/`) are written, the docs store is flushed, and only then is
`build_state.json` advanced (corpus byte offset, rows, hash of the bytes read). A killed build rerun with the
same command truncates what came after the last committed shard and continues from there; its settings and
the corpus prefix must match. Then the index is built from the shards (faiss_index.py or bm25.py) and
`manifest.json` (manifest.py) is written last. Memory stays bounded by a shard plus the index itself.
reindex.py rebuilds another dense index type from a finished directory without re-encoding.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from retriever import bm25
from retriever.corpus import CorpusReader
from retriever.docstore import DocStoreWriter
from retriever.encoder import DEFAULT_ENCODER, EncoderSpec, resolve_encoder
from retriever.errors import RetrieverError
from retriever.manifest import (
    DENSE_TYPES,
    MANIFEST_FILE,
    Bm25Info,
    CorpusInfo,
    EncoderInfo,
    Manifest,
    atomic_write_text,
    partial_dir,
    read_manifest,
    write_manifest,
)

STATE_FILE = "build_state.json"
SHARDS_DIR, TOKENS_DIR, EMBEDDINGS_DIR = "shards", "tokens", "embeddings"
VOCAB_LOG = "tokenizer_vocab.partial.jsonl"  # BM25: the vocabulary so far, one JSON word a line, in id order


@dataclass(frozen=True)
class BuildConfig:
    corpus: Path
    out: Path
    index_type: str
    encoder: str = DEFAULT_ENCODER
    pooling: str | None = None
    prefix_style: str = "auto"
    query_prefix: str | None = None
    passage_prefix: str | None = None
    max_length: int = 256
    batch_size: int | None = None
    device: str | None = None
    precision: str = "auto"  # encoder compute dtype: encoder.resolve_precision
    shard_size: int = 16384
    skip_bad: bool = False
    restart: bool = False
    overwrite: bool = False
    keep_embeddings: bool = False
    use_gpu: bool = True
    threads: int | None = None  # CPU threads for torch and faiss (default: all cores)
    index_params: dict[str, Any] = field(default_factory=dict)
    k1: float = bm25.DEFAULT_K1
    b: float = bm25.DEFAULT_B
    progress: bool = True


@dataclass
class BuildState:
    params: dict[str, Any]
    shards: int = 0
    rows: int = 0
    docs_bytes: int = 0
    corpus_offset: int = 0
    corpus_line: int = 0
    corpus_row: int = 0
    prefix_sha256: str | None = None
    skipped: int = 0
    first_errors: list[str] = field(default_factory=list)
    encoded: bool = False
    finished: bool = False  # the manifest is written: what is left is dropping scaffolding and the rename
    encode_seconds: float = 0.0
    vocab_terms: int = 0  # BM25: committed words of VOCAB_LOG ...
    vocab_bytes: int = 0  # ... and its committed length (a resume cuts off what came after)


def load_vocab(path: Path, terms: int, nbytes: int) -> dict[str, int]:
    """The committed BM25 vocabulary (word -> id) from the append-only VOCAB_LOG, after cutting off what an
    interrupted commit wrote past `nbytes`."""
    if not path.exists():
        return {}
    os.truncate(path, nbytes)
    with open(path, encoding="utf-8") as f:
        words = [json.loads(line) for line in f]
    if len(words) != terms:
        raise RetrieverError(f"{path}: {len(words)} words, the build state says {terms}; pass --restart")
    return {word: i for i, word in enumerate(words)}


def append_vocab(path: Path, word_to_id: dict[str, int], terms: int, nbytes: int) -> tuple[int, int]:
    """Append the words added since the last commit (the first `terms` are already there) and sync; returns
    the new (terms, nbytes). Each commit writes only its new words, not the whole vocabulary again."""
    new = list(itertools.islice(word_to_id.items(), terms, None))
    if any(wid != terms + i for i, (_, wid) in enumerate(new)):
        raise RetrieverError("the BM25 tokenizer numbered its words out of insertion order; cannot log them")
    data = "".join(json.dumps(word, ensure_ascii=False) + "\n" for word, _ in new).encode()
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return terms + len(new), nbytes + len(data)


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2))


def _log(cfg: BuildConfig, message: str) -> None:
    if cfg.progress:
        print(message, file=sys.stderr, flush=True)


def _content_params(cfg: BuildConfig, spec: EncoderSpec | None) -> dict[str, Any]:
    """What the shards depend on: a partial build resumes only under the same values."""
    if spec is None:
        return {"kind": "bm25", "stopwords": bm25.DEFAULT_STOPWORDS, "shard_size": cfg.shard_size}
    from retriever.encoder import on_gpu, resolve_precision

    return {
        "kind": "dense", "encoder": spec.name, "fingerprint": spec.fingerprint, "pooling": spec.pooling,
        "query_prefix": spec.query_prefix, "passage_prefix": spec.passage_prefix,
        "max_length": spec.max_length, "shard_size": cfg.shard_size,
        "precision": resolve_precision(cfg.precision, on_gpu(cfg.device)),
    }  # fmt: skip


def _open_state(cfg: BuildConfig, work: Path, params: dict[str, Any]) -> BuildState:
    if cfg.restart and work.exists():
        shutil.rmtree(work)
    if (work / STATE_FILE).exists():
        state = BuildState(**json.loads((work / STATE_FILE).read_text()))
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
    if cfg.out.exists() and not cfg.overwrite:
        raise RetrieverError(f"{cfg.out} already exists; pass --overwrite to replace it")
    if not cfg.corpus.exists():
        raise RetrieverError(f"corpus {cfg.corpus}: no such file")
    if cfg.shard_size < 1:
        raise RetrieverError("--shard-size must be at least 1")
    dense = cfg.index_type in DENSE_TYPES
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
        _finish(cfg, work, manifest, state)
        return manifest
    started = time.time()
    if not state.encoded:
        _encode_corpus(cfg, spec, work, state)
    if state.rows == 0:
        raise RetrieverError(f"corpus {cfg.corpus}: no passages (only blank or skipped lines)")
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
        bm25=None if dense else Bm25Info(k1=cfg.k1, b=cfg.b, method=bm25.DEFAULT_METHOD, stopwords=bm25.DEFAULT_STOPWORDS),
        corpus=CorpusInfo(
            source=str(cfg.corpus), rows=state.rows, bytes=state.corpus_offset, sha256=state.prefix_sha256 or "",
            skipped_lines=state.skipped,
        ),
        index_params=index_params,
        build=_build_info(state, index_seconds=time.time() - index_started, total_seconds=time.time() - started),
    )  # fmt: skip
    _finish(cfg, work, manifest, state)
    return manifest


def _build_info(state: BuildState, index_seconds: float, total_seconds: float) -> dict[str, Any]:
    import faiss

    rate = state.rows / state.encode_seconds if state.encode_seconds else None
    return {
        "encode_seconds": round(state.encode_seconds, 3), "index_seconds": round(index_seconds, 3),
        "passages_per_second": round(rate, 1) if rate else None, "seconds_this_run": round(total_seconds, 3),
        "faiss_version": faiss.__version__, "first_skipped": state.first_errors,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip


def _encode_corpus(cfg: BuildConfig, spec: EncoderSpec | None, work: Path, state: BuildState) -> None:
    """Stream the corpus into shards, committing the build state after each one."""
    from tqdm import tqdm

    shard_dir = work / (SHARDS_DIR if spec is not None else TOKENS_DIR)
    shard_dir.mkdir(exist_ok=True)
    encoder = None
    if spec is not None:
        from retriever.encoder import DenseEncoder

        encoder = DenseEncoder(spec, device=cfg.device, batch_size=cfg.batch_size, threads=cfg.threads,
                               precision=cfg.precision)
    tokenizer = None
    if spec is None:
        tokenizer = bm25.new_tokenizer(word_to_id=load_vocab(work / VOCAB_LOG, state.vocab_terms, state.vocab_bytes))
    corpus_bytes = cfg.corpus.stat().st_size if cfg.corpus.is_file() else 0
    docs = DocStoreWriter(work, rows=state.rows, nbytes=state.docs_bytes)
    bar = tqdm(desc=f"encode {cfg.index_type}", unit="passage", initial=state.rows, disable=not cfg.progress, smoothing=0.1)
    session_started, session_rows = time.time(), state.rows
    texts: list[str] = []
    pending_errors: list[str] = []  # bad lines since the last commit: a resumed build reads them again

    def commit(reader: CorpusReader) -> None:
        if corpus_bytes and reader.offset:  # the bar's total, from the mean bytes per passage so far
            bar.total = max(state.rows + len(texts), round(corpus_bytes * reader.row / reader.offset))
        if encoder is not None:
            vectors = encoder.encode(texts, "passage", on_batch=bar.update)
            tmp = shard_dir / f".{state.shards:05d}.tmp.npy"
            np.save(tmp, vectors)
            tmp.rename(shard_dir / f"{state.shards:05d}.npy")
        else:
            bm25.save_shard(shard_dir, state.shards, *bm25.tokenize_passages(tokenizer, texts))
            state.vocab_terms, state.vocab_bytes = append_vocab(
                work / VOCAB_LOG, tokenizer.word_to_id, state.vocab_terms, state.vocab_bytes)
            bar.update(len(texts))
        state.rows, state.docs_bytes = docs.commit()
        state.encode_seconds = encode_before + time.time() - session_started
        state.shards += 1
        state.corpus_offset, state.corpus_line, state.corpus_row = reader.offset, reader.line_no, reader.row
        state.prefix_sha256 = reader.sha256()
        _count_skipped(state, pending_errors)
        atomic_write_json(work / STATE_FILE, asdict(state))
        texts.clear()

    encode_before = state.encode_seconds
    try:
        with open(cfg.corpus, "rb") as stream:
            reader = CorpusReader(
                stream, skip_bad=cfg.skip_bad, start_offset=state.corpus_offset, start_line=state.corpus_line,
                start_row=state.corpus_row, prefix_sha256=state.prefix_sha256,
            )  # fmt: skip
            for line in reader:
                if line.passage is None:
                    pending_errors.append(line.error or "")
                    continue
                texts.append(line.passage.contents)
                docs.append(line.passage.to_json_line())
                if len(texts) == cfg.shard_size:
                    commit(reader)
            if texts:
                commit(reader)
            state.corpus_offset, state.prefix_sha256 = reader.offset, reader.sha256()
            _count_skipped(state, pending_errors)
    finally:
        docs.close()
        bar.close()
    state.encoded = True
    atomic_write_json(work / STATE_FILE, asdict(state))
    rate = (state.rows - session_rows) / max(time.time() - session_started, 1e-9)
    skipped = f"; skipped {state.skipped} bad lines (first: {state.first_errors[0]})" if state.skipped else ""
    _log(cfg, f"read {state.rows} passages in {state.shards} shards ({rate:.1f} passages/s this run){skipped}")


def _count_skipped(state: BuildState, errors: list[str]) -> None:
    state.skipped += len(errors)
    state.first_errors.extend(errors[: max(0, 5 - len(state.first_errors))])
    errors.clear()


def shard_reader(directory: Path, n_shards: int):
    """Shards of embeddings as a re-iterable source, each memory-mapped while it is added."""
    return lambda: (np.load(directory / f"{i:05d}.npy", mmap_mode="r") for i in range(n_shards))


def sample_rows(n: int, m: int) -> np.ndarray:
    """min(m, n) of the row numbers 0..n-1, drawn uniformly without replacement (seeded), sorted."""
    return np.sort(np.random.default_rng(0).choice(n, size=min(m, n), replace=False))


def shard_sampler(directory: Path, n_shards: int, shard_size: int, n_rows: int):
    """`sample(m)`: m rows drawn uniformly without replacement (seeded), read shard by shard."""

    def sample(m: int) -> np.ndarray:
        rows = sample_rows(n_rows, m)
        parts = []
        for shard in range(n_shards):
            mask = (rows // shard_size) == shard
            if mask.any():
                parts.append(np.load(directory / f"{shard:05d}.npy", mmap_mode="r")[rows[mask] % shard_size])
        return np.concatenate(parts)

    return sample


def _index_dense(cfg: BuildConfig, work: Path, state: BuildState) -> tuple[int, dict[str, Any]]:
    from retriever.faiss_index import INDEX_FILE, build_faiss, resolve_params, set_threads, write_faiss

    set_threads(cfg.threads)
    shards = work / SHARDS_DIR
    dim = int(np.load(shards / "00000.npy", mmap_mode="r").shape[1])
    params = resolve_params(cfg.index_type, state.rows, dim, cfg.index_params)
    _log(cfg, f"building {cfg.index_type} index over {state.rows} vectors of {dim} dims ({params})")
    index = build_faiss(
        cfg.index_type, dim, params, shard_reader(shards, state.shards),
        shard_sampler(shards, state.shards, cfg.shard_size, state.rows), cfg.use_gpu,
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
    for leftover in (SHARDS_DIR, TOKENS_DIR):
        if (work / leftover).exists():
            shutil.rmtree(work / leftover)
    for leftover in (VOCAB_LOG, STATE_FILE):
        (work / leftover).unlink(missing_ok=True)
    publish(work, cfg.out, cfg.overwrite)
    _log(cfg, f"wrote {cfg.out}: {manifest.index_type}, {manifest.corpus.rows} passages")


def publish(work: Path, out: Path, overwrite: bool) -> None:
    """Rename a finished `work` directory to `out` (replacing an old `out` only when asked)."""
    for stale in out.parent.glob(f".{out.name}.old-*"):  # an old index a killed --overwrite left aside
        shutil.rmtree(stale, ignore_errors=True)
    old = None
    if out.exists():
        if not overwrite:
            raise RetrieverError(f"{out} already exists; pass --overwrite to replace it")
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
