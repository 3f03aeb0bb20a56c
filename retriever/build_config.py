"""An index build's settings (`retriever build`'s options): what build.py runs and ingest.py reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retriever import bm25
from retriever.corpus import DEFAULT_MAX_PASSAGE_CHARS
from retriever.encoder import DEFAULT_ENCODER


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
    max_passage_chars: int = DEFAULT_MAX_PASSAGE_CHARS  # each string field of a row is cut to this
    restart: bool = False
    overwrite: bool = False
    keep_embeddings: bool = False
    use_gpu: bool = True
    threads: int | None = None  # CPU threads for torch and faiss (default: all cores)
    index_params: dict[str, Any] = field(default_factory=dict)
    k1: float = bm25.DEFAULT_K1
    b: float = bm25.DEFAULT_B
    progress: bool = True
