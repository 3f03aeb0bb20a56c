"""Streaming the corpus into a partial build: the resumable state, the shards, and what the rows were like.

`ingest_corpus` reads the corpus (corpus.py) in shards of `shard_size` passages. For each shard, its
`_ShardWriter` writes the embeddings (`shards/NNNNN.npy`) or BM25 token ids (`tokens/`), a 64-bit hash of
each passage's id (`ids/NNNNN.npy`, for counting duplicate ids at the end without holding the ids), flushes
the docs store, and only then advances `build_state.json` (corpus byte offset, rows, hash of the bytes
read, and the counts of skipped, truncated and empty rows with their first lines). A rerun continues after
the last committed shard, re-reading (and so re-checking) the bytes before it. A build whose corpus was
read to the end is read again on a rerun too: the prefix hash proves it unchanged, and rows appended since
are added rather than silently left out. build.py drives it and indexes the shards; reindex.py reads
embeddings kept by `--keep-embeddings` through `shard_reader` and `shard_sampler`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from retriever import bm25
from retriever.corpus import CorpusLine, CorpusReader
from retriever.docstore import DocStore, DocStoreWriter
from retriever.errors import RetrieverError
from retriever.manifest import atomic_write_text

if TYPE_CHECKING:
    from retriever.build_config import BuildConfig
    from retriever.encoder import EncoderSpec

STATE_FILE = "build_state.json"
SHARDS_DIR, TOKENS_DIR, IDS_DIR, EMBEDDINGS_DIR = "shards", "tokens", "ids", "embeddings"
VOCAB_LOG = "tokenizer_vocab.partial.jsonl"  # BM25: the vocabulary so far, one JSON word a line, in id order
NOTE_KINDS = ("skipped", "truncated", "empty")  # bad lines (--skip-bad), rows cut to the cap, empty contents
FIRST_NOTES = 5  # how many examples of each kind the manifest keeps


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
    counts: dict[str, int] = field(default_factory=dict)  # NOTE_KINDS -> rows so far
    examples: dict[str, list[str]] = field(default_factory=dict)  # NOTE_KINDS -> the first FIRST_NOTES
    encoded: bool = False  # the corpus was read to its end (a rerun reads it again for appended rows)
    finished: bool = False  # the manifest is written: what is left is dropping scaffolding and the rename
    encode_seconds: float = 0.0
    vocab_terms: int = 0  # BM25: committed words of VOCAB_LOG ...
    vocab_bytes: int = 0  # ... and its committed length (a resume cuts off what came after)

    def note(self, pending: list[tuple[str, str]]) -> None:
        """Count the rows noted since the last commit (a resumed build reads those lines again)."""
        for kind, example in pending:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            first = self.examples.setdefault(kind, [])
            if len(first) < FIRST_NOTES:
                first.append(example)
        pending.clear()


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2))


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


def id_hash(doc_id: Any) -> int:
    """64 bits of a hash of the id's JSON text: ids 7 and "7" differ, as they do to a client."""
    return int.from_bytes(hashlib.blake2b(json.dumps(doc_id).encode(), digest_size=8).digest(), "little")


def _save_npy(directory: Path, name: str, array: np.ndarray) -> None:
    tmp = directory / f".{name}.tmp.npy"
    np.save(tmp, array)
    tmp.rename(directory / f"{name}.npy")


def ingest_corpus(cfg: BuildConfig, spec: EncoderSpec | None, work: Path, state: BuildState, log) -> None:
    """Stream the corpus into shards after the last committed one, committing the state after each."""
    shards = _ShardWriter(cfg, spec, work, state)
    try:
        with open(cfg.corpus, "rb") as stream:
            reader = CorpusReader(
                stream, skip_bad=cfg.skip_bad, max_chars=cfg.max_passage_chars, start_offset=state.corpus_offset,
                start_line=state.corpus_line, start_row=state.corpus_row, prefix_sha256=state.prefix_sha256,
            )  # fmt: skip
            for line in reader:
                shards.add(line, reader)
            shards.finish(reader)
    finally:
        shards.close()
    state.encoded = True
    atomic_write_json(work / STATE_FILE, asdict(state))
    shards.report(log)


class _ShardWriter:
    """One run of `ingest_corpus`: the passages read since the last commit, and how a shard is committed."""

    def __init__(self, cfg: BuildConfig, spec: EncoderSpec | None, work: Path, state: BuildState) -> None:
        from tqdm import tqdm

        self.cfg, self.spec, self.work, self.state = cfg, spec, work, state
        self.shard_dir = work / (SHARDS_DIR if spec is not None else TOKENS_DIR)
        self.ids_dir = work / IDS_DIR
        for directory in (self.shard_dir, self.ids_dir):
            directory.mkdir(exist_ok=True)
        self.encoder = None  # loaded at the first shard: a rerun that finds nothing new never loads the model
        self.tokenizer = None
        if spec is None:
            self.tokenizer = bm25.new_tokenizer(
                word_to_id=load_vocab(work / VOCAB_LOG, state.vocab_terms, state.vocab_bytes))
        self.corpus_bytes = cfg.corpus.stat().st_size if cfg.corpus.is_file() else 0
        self.docs = DocStoreWriter(work, rows=state.rows, nbytes=state.docs_bytes)
        self.bar = tqdm(desc=f"encode {cfg.index_type}", unit="passage", initial=state.rows,
                        disable=not cfg.progress, smoothing=0.1)
        self.started, self.start_rows, self.encode_before = time.time(), state.rows, state.encode_seconds
        self.texts: list[str] = []
        self.hashes: list[int] = []
        self.pending: list[tuple[str, str]] = []  # noted since the last commit: a resume reads them again

    def add(self, line: CorpusLine, reader: CorpusReader) -> None:
        """Take one corpus line: its passage, or a note of why it has none; commit the shard once full."""
        passage = line.passage
        if passage is None:
            self.pending.append(("skipped", line.error or ""))
            return
        if passage.truncated:
            self.pending.append(("truncated", f"corpus line {reader.line_no}"))
        if passage.empty:
            self.pending.append(("empty", f"corpus line {reader.line_no}"))
        self.texts.append(passage.contents)
        self.hashes.append(id_hash(passage.id))
        self.docs.append(passage.to_json_line())
        if len(self.texts) == self.cfg.shard_size:
            self.commit(reader)

    def commit(self, reader: CorpusReader) -> None:
        """Write the shard's embeddings or token ids and its id hashes, flush the docs store, and only then
        advance the build state."""
        state = self.state
        if self.corpus_bytes and reader.offset:  # the bar's total, from the mean bytes per passage so far
            estimate = round(self.corpus_bytes * reader.row / reader.offset)
            self.bar.total = max(state.rows + len(self.texts), estimate)
        name = f"{state.shards:05d}"
        if self.spec is not None:
            self._write_embeddings(name)
        else:
            self._write_tokens()
        _save_npy(self.ids_dir, name, np.array(self.hashes, dtype=np.uint64))
        state.rows, state.docs_bytes = self.docs.commit()
        state.encode_seconds = self.encode_before + time.time() - self.started
        state.shards += 1
        state.corpus_offset, state.corpus_line, state.corpus_row = reader.offset, reader.line_no, reader.row
        state.prefix_sha256 = reader.sha256()
        state.note(self.pending)
        atomic_write_json(self.work / STATE_FILE, asdict(state))
        self.texts.clear()
        self.hashes.clear()

    def _write_embeddings(self, name: str) -> None:
        if self.encoder is None:
            from retriever.encoder import DenseEncoder

            cfg = self.cfg
            self.encoder = DenseEncoder(self.spec, device=cfg.device, batch_size=cfg.batch_size,
                                        threads=cfg.threads, precision=cfg.precision)
        _save_npy(self.shard_dir, name, self.encoder.encode(self.texts, "passage", on_batch=self.bar.update))

    def _write_tokens(self) -> None:
        state = self.state
        bm25.save_shard(self.shard_dir, state.shards, *bm25.tokenize_passages(self.tokenizer, self.texts))
        state.vocab_terms, state.vocab_bytes = append_vocab(
            self.work / VOCAB_LOG, self.tokenizer.word_to_id, state.vocab_terms, state.vocab_bytes)
        self.bar.update(len(self.texts))

    def finish(self, reader: CorpusReader) -> None:
        """At the corpus's end: commit the rows left over, then note the corpus read to its end (offset, hash)
        and the lines skipped after its last passage."""
        if self.texts:
            self.commit(reader)
        self.state.corpus_offset, self.state.prefix_sha256 = reader.offset, reader.sha256()
        self.state.note(self.pending)

    def close(self) -> None:
        self.docs.close()
        self.bar.close()

    def report(self, log) -> None:
        """Log this run's reading rate, if it read anything."""
        state = self.state
        if state.rows > self.start_rows:
            rate = (state.rows - self.start_rows) / max(time.time() - self.started, 1e-9)
            log(f"read {state.rows} passages in {state.shards} shards ({rate:.1f} passages/s this run)")


def count_duplicate_ids(work: Path, n_shards: int) -> tuple[int, list[str]]:
    """(rows whose id an earlier row already has, the first few such ids as JSON), from the id hashes."""
    if n_shards == 0:
        return 0, []
    hashes = np.concatenate([np.load(work / IDS_DIR / f"{i:05d}.npy") for i in range(n_shards)])
    order = np.argsort(hashes, kind="stable")  # equal hashes stay in row order: the first is the original
    ordered = hashes[order]
    repeats = np.sort(order[np.flatnonzero(ordered[1:] == ordered[:-1]) + 1])
    docs = DocStore(work)
    try:
        examples = list(dict.fromkeys(json.dumps(docs.get(int(r))["id"], ensure_ascii=False) for r in repeats[:50]))
    finally:
        docs.close()
    return int(repeats.size), examples[:FIRST_NOTES]


def shard_reader(directory: Path, n_shards: int):
    """Shards of embeddings as a re-iterable source, each memory-mapped while it is added."""
    return lambda: (np.load(directory / f"{i:05d}.npy", mmap_mode="r") for i in range(n_shards))


def sample_rows(n: int, m: int) -> np.ndarray:
    """min(m, n) of the row numbers 0..n-1, drawn uniformly without replacement (seeded), sorted."""
    return np.sort(np.random.default_rng(0).choice(n, size=min(m, n), replace=False))


def shard_sampler(directory: Path, n_shards: int, n_rows: int):
    """`sample(m)`: m rows drawn uniformly without replacement (seeded), read shard by shard. Shards may
    differ in size (a build resumed for appended rows adds shards after a short one)."""

    def sample(m: int) -> np.ndarray:
        shards = [np.load(directory / f"{i:05d}.npy", mmap_mode="r") for i in range(n_shards)]
        starts = np.cumsum([0] + [len(s) for s in shards])
        rows = sample_rows(n_rows, m)
        parts = []
        for shard, lo, hi in zip(shards, starts[:-1], starts[1:], strict=True):
            chosen = rows[(rows >= lo) & (rows < hi)]
            if chosen.size:
                parts.append(shard[chosen - lo])
        return np.concatenate(parts)

    return sample
