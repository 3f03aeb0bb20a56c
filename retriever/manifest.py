"""`manifest.json`: what an index directory holds, written last by build.py and checked by searcher.py.

It names the index type and its parameters, the encoder (name, fingerprint, pooling, prefixes, max length,
dimension) or the BM25 parameters and text analysis (analyzer.py's ANALYZER), the corpus (rows, bytes,
sha256; skipped lines, passages cut to the size cap, empty contents and duplicate ids) and the format
version.
A server refuses to start on a directory whose manifest does not match what it would search with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retriever.analyzer import ANALYZER
from retriever.bm25 import DEFAULT_B, DEFAULT_K1
from retriever.errors import RetrieverError

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
IndexType = Literal["flat", "hnsw", "ivfpq", "bm25"]
DENSE_TYPES = ("flat", "hnsw", "ivfpq")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EncoderInfo(_Strict):
    name: str  # as given to the build: a hub id (resolved again at serve time) or a local path
    fingerprint: str  # see encoder.model_fingerprint: a relocated copy of the same model passes, another fails
    pooling: Literal["mean", "cls"]
    query_prefix: str
    passage_prefix: str
    max_length: int
    dimension: int


class CorpusInfo(_Strict):
    source: str
    rows: int
    bytes: int
    sha256: str
    skipped_lines: int = 0  # bad lines skipped under --skip-bad
    max_passage_chars: int | None = None  # the per-field size cap (None: an index built before there was one)
    truncated: int = 0  # passages with a string field cut to the cap
    empty_contents: int = 0  # passages whose `contents` is empty or blank (indexed, and counted)
    duplicate_ids: int = 0  # passages whose id an earlier passage already has


class Bm25Info(_Strict):
    k1: float
    b: float
    method: str
    analyzer: str  # how text became terms (analyzer.ANALYZER); queries must be analyzed the same way


class Manifest(_Strict):
    format_version: int = FORMAT_VERSION
    index_type: IndexType
    dimension: int | None = None  # dense indexes only
    encoder: EncoderInfo | None = None
    bm25: Bm25Info | None = None
    corpus: CorpusInfo
    index_params: dict[str, Any] = Field(default_factory=dict)
    build: dict[str, Any] = Field(default_factory=dict)  # timings, library versions, where it was built

    @property
    def is_dense(self) -> bool:
        return self.index_type in DENSE_TYPES


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a synced temporary file and a rename: a reader (or a resumed build) sees the whole
    file or the previous one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    atomic_write_text(directory / MANIFEST_FILE, manifest.model_dump_json(indent=2) + "\n")


def partial_dir(out: Path) -> Path:
    """Where a build of `out` is written until it is complete (then renamed to `out`)."""
    return out.with_name(out.name + ".partial")


def _check_bm25_analyzer(path: Path, data: dict[str, Any]) -> None:
    """A BM25 index holds the terms of the analysis it was built with: searched with other terms, its
    queries would silently miss ("flights" looked up as "flight"), so it is refused, with the command
    that rebuilds it."""
    info = data.get("bm25")
    if data.get("index_type") != "bm25" or not isinstance(info, dict) or info.get("analyzer") == ANALYZER:
        return
    built = (f"analyzer {info['analyzer']!r}" if "analyzer" in info else
             "an earlier tokenizer (lowercase words of two or more letters or digits, unstemmed)")
    corpus = data["corpus"].get("source", "CORPUS") if isinstance(data.get("corpus"), dict) else "CORPUS"
    options = "".join(f" --{name} {info[name]}" for name, default in (("k1", DEFAULT_K1), ("b", DEFAULT_B))
                      if info.get(name, default) != default)  # fmt: skip
    raise RetrieverError(
        f"{path}: a BM25 index built with {built}; this version searches with analyzer {ANALYZER!r} "
        "(Lucene's EnglishAnalyzer), whose terms that index does not hold; rebuild the index: "
        f"agentrl retriever build --corpus {corpus} --index bm25{options} --out {path.parent} --overwrite"
    )


def read_manifest(directory: Path) -> Manifest:
    """Load and check a manifest, with errors that say what the directory is instead."""
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        partial = partial_dir(directory)
        hint = f"; an unfinished build is in {partial} (run the same build command to resume it)" if partial.exists() else ""
        raise RetrieverError(f"{directory}: no such index directory{hint}")
    if not path.exists():
        raise RetrieverError(f"{directory}: no {MANIFEST_FILE}; not an index directory built by `retriever build`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RetrieverError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    version = data.get("format_version") if isinstance(data, dict) else None
    if version != FORMAT_VERSION:
        raise RetrieverError(f"{path}: format_version {version!r}, this server reads version {FORMAT_VERSION}; rebuild the index")
    _check_bm25_analyzer(path, data)
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise RetrieverError(f"{path}: invalid manifest: {problems}") from None
    if manifest.is_dense and (manifest.encoder is None or manifest.dimension != manifest.encoder.dimension):
        raise RetrieverError(f"{path}: a dense index needs an encoder whose dimension equals `dimension`")
    if manifest.index_type == "bm25" and manifest.bm25 is None:
        raise RetrieverError(f"{path}: a bm25 index needs a `bm25` section")
    return manifest
