"""The dense index families over L2-normalised embeddings (inner product = cosine): Flat, HNSW, IVF-PQ.

`resolve_params` fills the automatic parameters from the corpus size and dimension (a pure function, so
the manifest records exactly what was built). `build_faiss` adds the embedding shards one at a time (the
embeddings never sit in RAM twice) and trains IVF-PQ on a random sample. With faiss-gpu and GPUs, IVF-PQ
is trained and filled on the first GPU (one index: faiss's sharded wrapper takes a single add() and would
train each shard on its own), and Flat and IVF-PQ are searched sharded across all of them (fp16); a Flat
build stays on the CPU (its adds are copies), as does HNSW (no GPU version).
build.py calls the builder; searcher.py loads and searches.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from retriever.errors import RetrieverError

try:
    import faiss
except ImportError as e:  # an extra: faiss-cpu, or faiss-gpu with the gpu extra (one of them: both are `faiss`)
    raise RetrieverError(f"dense indexes need faiss ({e}): pip install 'agentrl[faiss-cpu]', or 'agentrl[gpu]' "
                         "on NVIDIA GPUs (faiss-gpu), never both; BM25 indexes need neither") from e

from retriever.ranking import best_first, exact_scores

INDEX_FILE = "index.faiss"
MIN_POINTS_PER_CENTROID = 39  # below this faiss's k-means warns and the clusters are poor
PQ_POINTS_PER_CENTROID = 10  # PQ sub-spaces have few dims: 10 points per code word train them well enough
GPU_PQ_SIZES = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)
RESCORE_MARGIN = 16  # candidates asked for beyond k, re-scored exactly before the k best are kept


# Exhaustive (Flat) search of this many queries or more goes through one BLAS matrix product instead of a
# SIMD scan per query. faiss's own default (128,000) would scan a dynamic batch query by query, though one
# pass over the vectors for all of them costs less from a few queries on; a query or two scan faster.
BLAS_THRESHOLD = 4


def set_threads(threads: int | None) -> None:
    if threads:
        faiss.omp_set_num_threads(threads)


def gpu_count() -> int:
    """GPUs faiss can build and search on: 0 without faiss-gpu, without GPUs, or where faiss-gpu's kernels
    do not run on them (see `probe_gpu_kernels`)."""
    n = faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0
    return n if n and probe_gpu_kernels()[0] else 0


_PROBE = """
import numpy as np, faiss
from retriever.faiss_index import _to_all_gpus
x = np.random.default_rng(0).standard_normal((64, 32)).astype("float32")
cpu = faiss.IndexFlatIP(32)
cpu.add(x)
assert (_to_all_gpus(cpu).search(x[:4], 1)[1][:, 0] == np.arange(4)).all(), "wrong nearest neighbours"
"""


@lru_cache(maxsize=1)
def probe_gpu_kernels() -> tuple[bool, str]:
    """Clone a tiny index to every GPU as `_to_all_gpus` does and search it, in a child process: a faiss-gpu
    build without kernels for these GPUs (PyPI's faiss-gpu-cu12 1.14 on Hopper: "no kernel image is
    available") aborts the process instead of raising. Returns (usable, the failure's last line)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        reason = "the probe did not finish in 600 s"
    else:
        if done.returncode == 0:
            return True, ""
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        detail = next((line for line in reversed(lines) if "error" in line.lower() or "assert" in line.lower()), None)
        reason = detail or (lines[-1] if lines else f"exit status {done.returncode}")
    print(f"faiss-gpu cannot run on these GPUs, using the CPU: {reason}", file=sys.stderr)  # once: cached
    return False, reason


def resolve_params(index_type: str, n: int, dim: int, given: dict[str, Any]) -> dict[str, Any]:
    """The build and search parameters of an index of `n` vectors of `dim`, `given` ones taking precedence."""
    p = {k: v for k, v in given.items() if v is not None}
    if index_type == "hnsw":
        p.setdefault("hnsw_m", 32)
        p.setdefault("ef_construction", 200)
        p.setdefault("ef_search", 128)
    elif index_type == "ivfpq":
        target = 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))
        p.setdefault("nlist", int(max(1, min(target, n // MIN_POINTS_PER_CENTROID))))
        # About 4 dims per sub-quantizer (16x smaller than Flat), from the sizes faiss-gpu supports.
        p.setdefault("pq_m", max((m for m in GPU_PQ_SIZES if dim % m == 0 and m <= max(1, dim // 4)), default=1))
        fit = int(math.log2(max(n, 1) / PQ_POINTS_PER_CENTROID)) if n >= 16 * PQ_POINTS_PER_CENTROID else 4
        p.setdefault("pq_nbits", max(4, min(8, fit)))
        p.setdefault("nprobe", int(min(p["nlist"], max(8, min(256, p["nlist"] // 16)))))
        wanted = max(40 * p["nlist"], 40 * 2 ** p["pq_nbits"], 100_000)
        p.setdefault("train_size", int(min(n, wanted, 1_000_000)))  # 1M x 768 floats: 3 GB while training
        if dim % p["pq_m"]:
            raise RetrieverError(f"--pq-m {p['pq_m']} must divide the dimension {dim}")
        if n < 2 ** p["pq_nbits"] or n < p["nlist"]:
            raise RetrieverError(
                f"IVF-PQ with {p['nlist']} lists and {p['pq_nbits']}-bit codes needs at least "
                f"{max(2 ** p['pq_nbits'], p['nlist'])} passages to train; the corpus has {n} (use flat or hnsw)"
            )
    return p


def make_index(index_type: str, dim: int, p: dict[str, Any]) -> faiss.Index:
    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, p["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = p["ef_construction"]
        return index
    if index_type == "ivfpq":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFPQ(quantizer, dim, p["nlist"], p["pq_m"], p["pq_nbits"], faiss.METRIC_INNER_PRODUCT)
        index.pq.cp.min_points_per_centroid = PQ_POINTS_PER_CENTROID  # warn below our threshold, not faiss's 39
        return index
    raise ValueError(f"unknown dense index type {index_type!r}")


def _to_all_gpus(index: faiss.Index) -> faiss.Index:
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


def _to_first_gpu(index: faiss.Index) -> faiss.Index:
    options = faiss.GpuClonerOptions()
    options.useFloat16 = True
    resources = faiss.StandardGpuResources()
    gpu = faiss.index_cpu_to_gpu(resources, 0, index, options)
    gpu.referenced_objects = [resources]  # faiss's own keep-alive field: the index must not outlive them
    return gpu


def _onto_gpus(index: faiss.Index, index_type: str, use_gpu: bool, for_build: bool = False) -> tuple[faiss.Index, bool]:
    """`index` on the GPUs when wanted and possible, else itself; and whether it went. For search, sharded
    over every GPU; for a build, IVF-PQ alone goes, to the first GPU (see the module docstring). faiss-gpu
    refuses indexes it cannot hold, such as IVF-PQ with codes of other than 8 bits (the automatic choice
    below 2,560 passages): those stay on the CPU, said on stderr. HNSW has no GPU version."""
    if not use_gpu or index_type == "hnsw" or (for_build and index_type != "ivfpq") or gpu_count() == 0:
        return index, False
    try:
        return (_to_first_gpu(index) if for_build else _to_all_gpus(index)), True
    except RuntimeError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        print(f"faiss-gpu cannot hold this index ({why}); using the CPU", file=sys.stderr)
        return index, False


def build_faiss(
    index_type: str,
    dim: int,
    params: dict[str, Any],
    shards: Callable[[], Iterator[np.ndarray]],
    sample: Callable[[int], np.ndarray],
    use_gpu: bool,
) -> faiss.Index:
    """Train (IVF-PQ, on `sample(train_size)`), then add every shard; returns a CPU index to write."""
    index, on_gpu = _onto_gpus(make_index(index_type, dim, params), index_type, use_gpu, for_build=True)
    if not index.is_trained:
        index.train(np.ascontiguousarray(sample(params["train_size"]), dtype=np.float32))
    for chunk in shards():
        index.add(np.ascontiguousarray(chunk, dtype=np.float32))
    return faiss.index_gpu_to_cpu(index) if on_gpu else index


def write_faiss(index: faiss.Index, path: Path) -> None:
    faiss.write_index(index, str(path))


class FaissSearch:
    """A loaded dense index with its search-time parameters set; `search` pads missing hits with -1."""

    def __init__(self, path: Path, index_type: str, params: dict[str, Any], *, mmap: bool, use_gpu: bool) -> None:
        # IVF maps its inverted lists (IO_FLAG_MMAP); Flat and HNSW their flat codes (IO_FLAG_MMAP_IFC).
        flags = 0
        if mmap:
            mapped = faiss.IO_FLAG_MMAP if index_type == "ivfpq" else faiss.IO_FLAG_MMAP_IFC
            flags = mapped | faiss.IO_FLAG_READ_ONLY
        try:
            index = faiss.read_index(str(path), flags)
        except RuntimeError as e:  # faiss's message is a C++ location and a failed check: keep the check
            why = str(e).strip().splitlines()[-1].split("failed: ")[-1]
            raise RetrieverError(f"{path}: faiss cannot read it ({why}): the file is truncated or corrupt; "
                                 "rebuild the index") from None
        faiss.cvar.distance_compute_blas_threshold = BLAS_THRESHOLD  # process-wide; see BLAS_THRESHOLD
        self.dimension = int(index.d)
        self.size = int(index.ntotal)
        self._stored = index  # the CPU index, whose vectors re-score the candidates (on GPU too)
        index, self.on_gpu = _onto_gpus(index, index_type, use_gpu)
        space = faiss.GpuParameterSpace() if self.on_gpu else faiss.ParameterSpace()
        if index_type == "ivfpq":
            space.set_index_parameter(index, "nprobe", int(params["nprobe"]))
        if index_type == "hnsw":
            space.set_index_parameter(index, "efSearch", int(params["ef_search"]))
        self._index = index
        self._ef_search = int(params.get("ef_search", 0))
        self._hnsw = index_type == "hnsw"
        # IVF-PQ keeps codes, not vectors: its own scores are ordered. On the CPU the lists it probes are
        # chosen by an exact search of its quantizer (a Flat index of centroids), as a Flat index is searched.
        self._rescore = index_type != "ivfpq"
        self._quantizer = faiss.downcast_index(index.quantizer) if index_type == "ivfpq" and not self.on_gpu else None
        if self._quantizer is not None:
            self._nprobe = int(params["nprobe"])
            centroids = self._quantizer.reconstruct_n(0, self._quantizer.ntotal)
            self._centroid_norm = float(np.linalg.norm(centroids, axis=1).max())
        # A Flat index on the CPU is exact: its float32 scores are within an error bound of the exact ones, so
        # the answer can be proved complete (see rescored_search). On GPUs the vectors are held in fp16.
        self._exact = index_type == "flat" and not self.on_gpu

    def _faiss_search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._hnsw and k > self._ef_search:  # HNSW returns at most efSearch results
            return self._index.search(x, k, params=faiss.SearchParametersHNSW(efSearch=k))
        return self._index.search(x, k)

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows) of each query's k best passages, best first, equal scores by row; rows -1 past the
        hits; each query's answer the same whatever the batch (see rescored_search)."""
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        norm = float(np.linalg.norm(x, axis=1).max(initial=0.0))
        if self._quantizer is None:
            return rescored_search(lambda todo, n: self._faiss_search(x[todo], n), self._stored if self._rescore else None,
                                   x, k, self.size, float_error(self.dimension, norm) if self._exact else None)
        probe_scores, probes = rescored_search(
            lambda todo, n: self._quantizer.search(x[todo], n), self._quantizer, x, self._nprobe, self._quantizer.ntotal,
            float_error(self.dimension, norm * self._centroid_norm),
        )  # fmt: skip

        def preassigned(todo: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
            return self._index.search_preassigned(x[todo], n, probes[todo], probe_scores[todo])

        return rescored_search(preassigned, None, x, k, self.size, None)


def float_error(dimension: int, norms: float) -> float:
    """A bound on how far faiss's float32 inner product of two vectors (the product of whose norms is
    `norms`) can be from the exact one: d roundings of 2^-24 each, doubled for safety."""
    return 2 * dimension * 2.0**-24 * norms


def rescored_search(
    search: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    stored: faiss.Index | None,
    x: np.ndarray,
    k: int,
    size: int,
    error: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows) of the k best of each query in `x`, best first, equal scores by row, rows -1 past the
    hits, computed so that a query's answer does not depend on the others: `search(queries, n)` (the
    positions of queries in `x`) is asked for RESCORE_MARGIN more candidates than k, which are re-scored
    exactly from `stored`'s vectors (ranking.py), or ordered by their own scores where `stored` is None.
    With `error`, the bound on the search's own scores (an exact index), a query is searched again with 4x
    the candidates while one outside them could still tie or beat its k-th: the last candidate's score
    plus the error must stay below the k-th exact score."""
    k = min(k, size)
    out_scores = np.zeros((len(x), k), dtype=np.float32)
    out_rows = np.full((len(x), k), -1, dtype=np.int64)
    todo, wanted = np.arange(len(x)), min(size, k + RESCORE_MARGIN)
    while todo.size:
        scores, rows = search(todo, wanted)
        if stored is not None:
            found = np.maximum(rows, 0)
            vectors = stored.reconstruct_batch(found.ravel()).reshape(*found.shape, x.shape[1])
            exact = np.where(rows >= 0, exact_scores(x[todo], vectors), -np.inf)
        else:
            exact = np.where(rows >= 0, scores.astype(np.float64), -np.inf)
        again = []
        for j, query in enumerate(todo):
            order = best_first(exact[j], rows[j])[:k]
            order = order[rows[j][order] >= 0]
            complete = error is None or wanted == size or len(order) < k or rows[j, -1] < 0
            if not complete and scores[j, -1] + error >= exact[j, order[-1]]:
                again.append(query)
                continue
            out_scores[query, : len(order)], out_rows[query, : len(order)] = exact[j, order], rows[j, order]
        todo, wanted = np.array(again, dtype=np.int64), min(size, wanted * 4)
    return out_scores, out_rows
