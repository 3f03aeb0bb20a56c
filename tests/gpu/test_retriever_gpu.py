"""GPU checks for the retriever (skipped without CUDA; the faiss-gpu one also without faiss-gpu).

    python3 -m pytest -q tests/gpu/test_retriever_gpu.py        # on the GPU machine, from the repo root

The encoder on CUDA runs in fp16 by default and must agree with the float32 CPU encoder to fp16's
precision; with faiss-gpu, a Flat index built and searched on the GPUs must return the CPU Flat's hits,
and IVF-PQ built on the GPUs must keep its recall against Flat. Needs faiss (faiss-gpu for the second
test), bm25s and the project's other retriever dependencies importable there. On Hopper GPUs, PyPI's
`faiss-gpu` 1.15.1 has kernels (`faiss-gpu-cu12` 1.14.1 does not: the second test then skips, naming
faiss's error); beside a CUDA 13 torch it needs `nvidia-cublas-cu12`, `nvidia-cuda-runtime-cu12` and
`nvidia-curand-cu12` in one `nvidia/` namespace directory on the path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_retriever_support import HAND_CORPUS, build_index, make_tiny_encoder, synthetic_corpus_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

K = 10


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    return make_tiny_encoder(tmp_path_factory)


def test_fp16_encoder_on_gpu_matches_float32_on_cpu(tiny_encoder):
    from retriever.encoder import DenseEncoder, resolve_encoder

    spec = resolve_encoder(str(tiny_encoder))
    texts = [d["contents"] for d in HAND_CORPUS]
    exact = DenseEncoder(spec, device="cpu", precision="float32").encode(texts, "passage")
    gpu = DenseEncoder(spec)  # defaults: cuda, precision auto
    assert gpu.device.startswith("cuda") and gpu.precision == "float16"
    got = gpu.encode(texts, "passage")
    assert got.dtype == np.float32 and got.shape == exact.shape
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-3)
    assert (got * exact).sum(axis=1).min() > 0.999


def test_faiss_gpu_flat_and_ivfpq_against_cpu(tmp_path, tiny_encoder, capsys):
    faiss = pytest.importorskip("faiss", reason="faiss is not installed here (pip install faiss-gpu)")

    from retriever.faiss_index import gpu_count, probe_gpu_kernels
    from retriever.searcher import open_index

    if not hasattr(faiss, "StandardGpuResources"):
        pytest.skip("faiss has no GPU support here (install faiss-gpu)")
    if gpu_count() == 0:
        pytest.skip(f"this faiss-gpu build cannot run on these GPUs: {probe_gpu_kernels()[1]}")
    path, corpus = synthetic_corpus_file(tmp_path / "corpus.jsonl", 2000)
    # shards of 300 passages: the builds add in 7 passes, as a real corpus's do (a sharded faiss-gpu index
    # took one add() only)
    settings = {"encoder": str(tiny_encoder), "precision": "float32", "shard_size": 300}
    build_index(path, tmp_path / "flat-cpu", "flat", use_gpu=False, **settings)
    build_index(path, tmp_path / "flat-gpu", "flat", use_gpu=True, **settings)
    # faiss-gpu's IVF-PQ holds 8-bit codes only; below 2,560 passages the automatic choice is fewer bits
    build_index(path, tmp_path / "ivfpq-gpu", "ivfpq", use_gpu=True, index_params={"pq_nbits": 8}, **settings)
    assert "cannot hold" not in capsys.readouterr().err  # IVF-PQ was trained and filled on the first GPU
    queries = corpus.queries(100)

    def top(directory: str, use_gpu: bool) -> np.ndarray:
        opened = open_index(tmp_path / directory, use_gpu=use_gpu, precision="float32", device="cpu")
        assert opened.index.faiss_search.on_gpu == use_gpu
        return opened.index.search(queries, K)[1]

    exact = top("flat-cpu", False)

    def recall(got: np.ndarray) -> float:
        return float(np.mean([len(set(a) & set(e)) / K for a, e in zip(got, exact, strict=True)]))

    flat_gpu = recall(top("flat-gpu", True))
    print(f"\nflat on GPU (fp16) vs CPU: recall@{K} {flat_gpu:.4f}")
    assert flat_gpu >= 0.95  # fp16 vectors swap near-ties of a random tiny encoder's near-collinear vectors
    approx = top("ivfpq-gpu", True)
    print(f"\nIVF-PQ built and searched on {gpu_count()} GPU(s): recall@{K} vs flat {recall(approx):.3f}")
    assert recall(approx) >= 0.4  # tests/test_retriever_recall.py's floor for the CPU build
