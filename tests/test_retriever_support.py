"""Helpers for the retriever tests (tests/test_retriever_*.py); this module holds no tests itself.

Tiny random BERT encoders saved to disk with a WordPiece tokenizer trained on the fly (no download), the
hand-checkable corpus, corpus writers, and `serving()`: a real uvicorn server on a loopback port in a
thread, ready once /health answers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from retriever.synthetic import SyntheticCorpus

REPO = Path(__file__).resolve().parents[1]
# One CPU thread for torch and faiss in the tests: on a shared machine, OpenMP threads spinning on busy
# cores make a 2-thread run several times slower than a 1-thread one. The results do not depend on it.
THREADS = 1

# Hand-checkable: one topic per passage, so the best passage for each test query is obvious.
HAND_CORPUS = [
    {"id": "hamlet", "contents": '"Hamlet"\nHamlet is a tragedy written by William Shakespeare around 1600.'},
    {"id": "paris", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "photosynthesis", "contents": '"Photosynthesis"\nPlants convert sunlight, water and carbon dioxide into sugar.'},
    {"id": "everest", "contents": '"Mount Everest"\nMount Everest is the highest mountain on Earth, in the Himalayas.'},
    {"id": "python", "contents": '"Python (programming language)"\nPython is a programming language created by Guido van Rossum.'},
    {"id": "jupiter", "contents": '"Jupiter"\nJupiter is the largest planet in the Solar System.'},
    {"id": "beethoven", "contents": '"Ludwig van Beethoven"\nBeethoven was a German composer of nine symphonies.'},
    {"id": "titanic", "contents": '"Titanic"\nThe Titanic sank in the North Atlantic in 1912 after hitting an iceberg.'},
]

_TRAINING_TEXT = [d["contents"] for d in HAND_CORPUS] + [
    "query: passage: Represent this sentence for searching relevant passages:",
    "who wrote what is the capital of which planet largest highest mountain composer ship sank",
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tiny_bert(directory: Path, *, hidden: int = 32, seed: int = 0, extra_text: list[str] | None = None) -> Path:
    """A 2-layer random BERT with a WordPiece tokenizer built here; saved like a hub model directory.

    The vocabulary is built, not trained: tokenizers' WordPiece trainer breaks ties between equally frequent
    merges in hash order, so the same text gave a different vocabulary (and token ids, and embeddings) in each
    process. Here it is the special tokens, then every character alone and as a continuation ("##x"), then
    every whole word of the text, each group sorted."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = {w for text in _TRAINING_TEXT + (extra_text or [])
             for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text))}
    chars = sorted({c for w in words for c in w})
    tokens = specials + chars + [f"##{c}" for c in chars] + sorted(words - set(chars))
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]"
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * hidden, max_position_embeddings=128, initializer_range=0.5,  # distinct vectors, CLS too
    )  # fmt: skip
    BertModel(config).eval().save_pretrained(directory)
    return directory


def reference_embeddings(model_dir: Path, texts: list[str], pooling: str = "mean") -> np.ndarray:
    """Embeddings computed here, independently of retriever/encoder.py: pooled, L2-normalised."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    out = []
    for text in texts:  # one at a time: no padding to get wrong
        batch = tok([text], truncation=True, max_length=128, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state[0]
        v = hidden[0] if pooling == "cls" else hidden.mean(0)
        out.append((v / v.norm()).numpy())
    return np.stack(out)


def synthetic_corpus_file(path: Path, n: int, seed: int = 0) -> tuple[Path, SyntheticCorpus]:
    corpus = SyntheticCorpus(n, seed=seed, words_per_passage=40)
    return corpus.write(path), corpus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 60.0, proc=None) -> dict:
    """Poll GET /health until it answers 200 (readiness polling, not a timing assumption)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            response = httpx.get(f"{url}/health", timeout=2.0)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s}s")


def wait_for_file(path: Path, ready, proc=None, timeout_s: float = 60.0) -> None:
    """Poll until `path` exists and `ready()` holds (a build committing its state, say)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if path.exists() and ready():
                return
        except (ValueError, KeyError):  # caught mid-rename: try again
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{path} not ready within {timeout_s}s")


@contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` under uvicorn on a loopback port in a background thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def serve_index(index_dir: Path, mmap: bool = False, precision: str = "float32", **settings):
    """A context manager serving an index directory (opened and checked like `retriever serve` does).
    float32 by default: tests compare scores with float32 references to 1e-5."""
    from retriever.searcher import open_index
    from retriever.server import ServerSettings, create_app

    opened = open_index(index_dir, threads=THREADS, mmap=mmap, precision=precision)
    return serving(create_app(opened, ServerSettings(**settings)))


def build_index(corpus: Path, out: Path, index_type: str = "flat", **kwargs):
    from retriever.build import build
    from retriever.build_config import BuildConfig

    kwargs.setdefault("threads", THREADS)
    kwargs.setdefault("precision", "float32")  # exact references; bf16 has its own test
    kwargs.setdefault("progress", False)
    return build(BuildConfig(corpus=corpus, out=out, index_type=index_type, **kwargs))


class Killed(BaseException):
    """Stands for SIGKILL at one point of a build (BaseException: nothing in the build may catch it)."""


def make_tiny_encoder(tmp_path_factory) -> Path:
    """A tiny random BERT (32 dims) whose tokenizer also knows the synthetic corpus's syllables."""
    extra = [p["contents"] for p in SyntheticCorpus(100, words_per_passage=40).passages()]
    return make_tiny_bert(tmp_path_factory.mktemp("encoders") / "tiny-encoder", extra_text=extra)
