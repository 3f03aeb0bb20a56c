"""Dense search on the GPU against the CPU: one Flat index, Search-R1's GRPO batch, the same answers.

Builds a Flat (exact inner product) index of `--vectors` unit vectors of MiniLM's 384 dimensions and opens
it twice through the retriever's own `FaissSearch`: with `use_gpu` (faiss-gpu shards it over every GPU in
fp16 and the candidates are re-scored exactly from the stored vectors, retriever/faiss_index.py) and
without (faiss on the CPU, every core). Then it times one batch of `--queries` queries (Search-R1's GRPO
step: 512 prompts x 5 samples) on each, alternating for `--rounds` rounds, and prints queries/s, the
GPU's ratio to the CPU and the share of queries whose k answers are the same rows in the same order.

The vectors are random (seeded): a Flat scan costs the same whatever the values, and random directions
in 384 dimensions have close scores, which is the harder case for fp16 candidates. Without faiss-gpu or a
GPU both sides run on the CPU, and the script says so.

    python -m bench.bench_retriever_gpu --vectors 1000000 --queries 2560 --k 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def unit_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384, help="MiniLM-L6's embedding size")
    parser.add_argument("--queries", type=int, default=2560, help="Search-R1's GRPO batch: 512 prompts x 5")
    parser.add_argument("--k", type=int, default=3, help="passages per query (Search-R1's topk)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    import faiss

    from retriever.faiss_index import INDEX_FILE, FaissSearch, gpu_count, write_faiss

    work = Path(tempfile.mkdtemp(prefix="bench_retriever_gpu_"))
    index = faiss.IndexFlatIP(args.dim)
    for start in range(0, args.vectors, 100_000):  # added in slices: the vectors never sit in RAM twice
        index.add(unit_vectors(min(100_000, args.vectors - start), args.dim, seed=start))
    write_faiss(index, work / INDEX_FILE)
    del index
    queries = unit_vectors(args.queries, args.dim, seed=10**9)
    sides = {"cpu": FaissSearch(work / INDEX_FILE, "flat", {}, mmap=False, use_gpu=False),
             "gpu": FaissSearch(work / INDEX_FILE, "flat", {}, mmap=False, use_gpu=True)}
    if not sides["gpu"].on_gpu:
        print(f"faiss sees {gpu_count()} usable GPUs: both sides run on the CPU")
    answers, seconds = {}, {name: [] for name in sides}
    for side in sides.values():  # a warm-up each: faiss-gpu's first search allocates its scratch memory
        side.search(queries[: args.k * 8], args.k)
    for _ in range(args.rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            answers[name] = side.search(queries, args.k)[1]
            seconds[name].append(time.perf_counter() - start)
    qps = {name: args.queries / statistics.median(s) for name, s in seconds.items()}
    same = float((answers["gpu"] == answers["cpu"]).all(axis=1).mean())
    print(f"| Flat, {args.vectors:,} x {args.dim} | queries/s (median of {args.rounds}) | batch s |")
    print("|---|---|---|")
    for name in sides:
        print(f"| {name}{' (faiss-gpu)' if name == 'gpu' and sides['gpu'].on_gpu else ''} | {qps[name]:,.0f} | "
              f"{statistics.median(seconds[name]):.3f} |")
    print(f"GPU against CPU: {qps['gpu'] / qps['cpu']:.1f}x; identical answers (k={args.k}): {100 * same:.2f}% of "
          f"{args.queries} queries")
    if args.out:
        Path(args.out).write_text(json.dumps({"qps": qps, "seconds": seconds, "identical": same,
                                              "on_gpu": sides["gpu"].on_gpu, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
