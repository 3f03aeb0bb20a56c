"""Opening an index directory for serving, with every consistency check done before the first request.

`open_index()` reads the manifest (manifest.py), maps the docs store (docstore.py), loads the FAISS or
BM25 index and, for a dense index, the encoder the manifest names (or a relocated copy given with
`--encoder`, which must be the same model: same fingerprint and dimension). Any mismatch (another encoder,
another dimension, a docs store or index of another size) is a RetrieverError at start-up, never garbage
results. The result's `search(queries, k)` is what batching.py calls: one encoder pass, one index search,
each computed so that a query's answer does not depend on the queries batched with it (the encoder's
`batch_invariant` mode, ranking.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from retriever.docstore import DocStore
from retriever.errors import RetrieverError
from retriever.manifest import Manifest, read_manifest


class Index(Protocol):
    size: int

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]: ...


class DenseIndex:
    """Queries -> encoder (with the manifest's query prefix) -> FAISS."""

    def __init__(self, encoder, faiss_search) -> None:
        self.encoder, self.faiss_search, self.size = encoder, faiss_search, faiss_search.size

    def search(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.faiss_search.search(self.encoder.encode(queries, "query"), k)


@dataclass
class OpenIndex:
    directory: Path
    manifest: Manifest
    index: Index
    docs: DocStore
    encoder_name: str

    def describe(self) -> dict[str, Any]:
        m = self.manifest
        precision = self.index.encoder.precision if isinstance(self.index, DenseIndex) else None
        return {
            "index_type": m.index_type, "size": self.index.size, "encoder": self.encoder_name,
            "encoder_precision": precision, "dimension": m.dimension, "corpus_sha256": m.corpus.sha256,
            "index_params": m.index_params,
        }  # fmt: skip


def _config_dimension(path: Path) -> int | None:
    config = json.loads((path / "config.json").read_text())
    for key in ("hidden_size", "d_model", "dim"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _check_encoder(manifest: Manifest, directory: Path, name: str | None):
    """The EncoderSpec to serve with: the manifest's, or `name` if it is a copy of the same model."""
    from retriever.encoder import model_fingerprint, resolve_encoder

    built = manifest.encoder
    assert built is not None  # read_manifest guarantees it for dense indexes
    spec = resolve_encoder(
        name or built.name, pooling=built.pooling, query_prefix=built.query_prefix,
        passage_prefix=built.passage_prefix, max_length=built.max_length,
    )  # fmt: skip
    dimension = _config_dimension(spec.path)
    if dimension is not None and dimension != built.dimension:
        raise RetrieverError(
            f"{directory} was built with encoder {built.name!r} of dimension {built.dimension}; "
            f"encoder {spec.name!r} ({spec.path}) has dimension {dimension}. Serve it with the encoder it was "
            "built with, or rebuild the index with this one"
        )
    current = spec.fingerprint if built.fingerprint.startswith("2:") else model_fingerprint(spec.path, scheme=1)
    if current != built.fingerprint:
        raise RetrieverError(
            f"{directory} was built with encoder {built.name!r}, and {spec.name!r} ({spec.path}) is a different "
            "model (its config, tokenizer or weights differ): its query vectors would not match the passage "
            "vectors. Serve with the encoder the index was built with, or rebuild the index"
        )
    return spec


def open_index(
    directory: Path,
    *,
    encoder: str | None = None,
    device: str | None = None,
    precision: str = "auto",
    use_gpu: bool = True,
    mmap: bool = False,
    threads: int | None = None,
) -> OpenIndex:
    manifest = read_manifest(directory)
    docs = DocStore(directory)
    if len(docs) != manifest.corpus.rows:
        raise RetrieverError(f"{directory}: the docs store has {len(docs)} rows, the manifest says {manifest.corpus.rows}")
    if manifest.is_dense:
        from retriever.encoder import DenseEncoder
        from retriever.faiss_index import INDEX_FILE, FaissSearch, set_threads

        set_threads(threads)
        if not (directory / INDEX_FILE).exists():
            raise RetrieverError(f"{directory}: missing {INDEX_FILE}")
        faiss_search = FaissSearch(directory / INDEX_FILE, manifest.index_type, manifest.index_params, mmap=mmap, use_gpu=use_gpu)
        if faiss_search.dimension != manifest.dimension or faiss_search.size != manifest.corpus.rows:
            raise RetrieverError(
                f"{directory}: {INDEX_FILE} holds {faiss_search.size} vectors of {faiss_search.dimension} dims, "
                f"the manifest says {manifest.corpus.rows} of {manifest.dimension}"
            )
        spec = _check_encoder(manifest, directory, encoder)
        dense_encoder = DenseEncoder(spec, device=device, threads=threads, precision=precision, batch_invariant=True)
        if dense_encoder.dimension != manifest.dimension:
            raise RetrieverError(f"encoder {spec.name!r} produces {dense_encoder.dimension} dims, the index holds {manifest.dimension}")
        return OpenIndex(directory, manifest, DenseIndex(dense_encoder, faiss_search), docs, spec.name)
    if encoder is not None:
        raise RetrieverError(f"{directory} is a BM25 index; --encoder applies to dense indexes only")
    from retriever.bm25 import BM25_DIR, Bm25Search

    bm25_search = Bm25Search(directory / BM25_DIR, threads=threads)
    if bm25_search.size != manifest.corpus.rows:
        raise RetrieverError(f"{directory}: the BM25 index holds {bm25_search.size} passages, the manifest says {manifest.corpus.rows}")
    return OpenIndex(directory, manifest, bm25_search, docs, "bm25")
