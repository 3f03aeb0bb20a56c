"""`retriever build --from-index SRC --index hnsw|ivfpq|flat --out DIR`: another dense index type over the
vectors of a finished index, without encoding the corpus again.

The vectors come from SRC's `embeddings/` (a build with `--keep-embeddings`) or, for a Flat index, from the
index itself (Flat stores the vectors; they are read back in chunks from a memory map). The docs store is
hard-linked (copied across filesystems); the new manifest keeps SRC's encoder and corpus and records the
new index parameters. Same atomic rename as build.py. The benchmark builds HNSW this way from Flat.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from retriever.build import partial_dir, publish
from retriever.docstore import DOCS_FILE, OFFSETS_FILE
from retriever.errors import RetrieverError
from retriever.ingest import EMBEDDINGS_DIR, sample_rows, shard_reader, shard_sampler
from retriever.manifest import DENSE_TYPES, Manifest, read_manifest, write_manifest
from retriever.outdir import build_lock, check_replaceable

_CHUNK = 65536


def _vector_source(src: Path, manifest: Manifest):
    """(shards, sample) callables over SRC's vectors, as build_faiss takes them."""
    from retriever.faiss_index import INDEX_FILE, faiss

    n = manifest.corpus.rows
    embeddings = src / EMBEDDINGS_DIR
    if embeddings.is_dir():
        n_shards = len(list(embeddings.glob("*.npy")))
        return shard_reader(embeddings, n_shards), shard_sampler(embeddings, n_shards, n)
    if manifest.index_type != "flat":
        raise RetrieverError(
            f"{src} is a {manifest.index_type} index without kept embeddings: its vectors cannot be read back. "
            "Reindex from a Flat index, or from a build made with --keep-embeddings"
        )
    index = faiss.read_index(str(src / INDEX_FILE), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)

    def shards():
        return (index.reconstruct_n(i, min(_CHUNK, n - i)) for i in range(0, n, _CHUNK))

    def sample(m: int) -> np.ndarray:
        return index.reconstruct_batch(sample_rows(n, m).astype(np.int64))

    return shards, sample


def reindex(
    src: Path,
    out: Path,
    index_type: str,
    index_params: dict[str, Any],
    *,
    use_gpu: bool = True,
    overwrite: bool = False,
    threads: int | None = None,
) -> Manifest:
    from retriever.faiss_index import set_threads

    set_threads(threads)
    manifest = read_manifest(src)
    if not manifest.is_dense or index_type not in DENSE_TYPES:
        raise RetrieverError(f"--from-index rebuilds dense indexes only ({src} is {manifest.index_type}, asked for {index_type})")
    with build_lock(out):  # exclusive with any other build into `out` (outdir.py)
        if out.exists():
            if not overwrite:
                raise RetrieverError(f"{out} already exists; pass --overwrite to replace it")
            check_replaceable(out)
        return _reindex_locked(src, out, manifest, index_type, index_params, use_gpu=use_gpu, overwrite=overwrite)


def _reindex_locked(
    src: Path, out: Path, manifest: Manifest, index_type: str, index_params: dict[str, Any], *, use_gpu: bool,
    overwrite: bool,
) -> Manifest:
    from retriever.faiss_index import INDEX_FILE, build_faiss, resolve_params, write_faiss

    assert manifest.dimension is not None  # read_manifest guarantees it for dense indexes
    started = time.time()
    work = partial_dir(out)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for name in (DOCS_FILE, OFFSETS_FILE):
        try:
            os.link(src / name, work / name)
        except OSError:
            shutil.copy2(src / name, work / name)
    shards, sample = _vector_source(src, manifest)
    params = resolve_params(index_type, manifest.corpus.rows, manifest.dimension, index_params)
    write_faiss(build_faiss(index_type, manifest.dimension, params, shards, sample, use_gpu), work / INDEX_FILE)
    new = manifest.model_copy(
        update={
            "index_type": index_type, "index_params": params,
            "build": {**manifest.build, "reindexed_from": str(src), "index_seconds": round(time.time() - started, 3)},
        }
    )  # fmt: skip
    write_manifest(work, new)
    publish(work, out, overwrite)
    return new
