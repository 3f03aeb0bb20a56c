"""The one order every index answers in: the best score first, equal scores in corpus order (the lower row
first, as Lucene breaks ties), computed so that a query's answer never depends on the queries searched
with it.

faiss's scores for a query shift in the last bits with the batch around it (its exhaustive search takes
BLAS for some batch sizes and SIMD scans for others, and BLAS rounds differently for different shapes),
and its heaps and bm25s's top-k return equal scores in no fixed order. So faiss_index.py re-scores the
candidates a search returns with `exact_scores`, a float64 sum computed row by row the same way whatever
else is in the batch, and both index families pick and order hits with `best_first` / `top_k`.
"""

from __future__ import annotations

import numpy as np


def exact_scores(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """(nq, c) inner products of queries (nq, d) with their candidates (nq, c, d), in float64: the products
    of float32 values are exact there, and numpy sums each row of d alike, so each score is a function of
    its two vectors alone."""
    return (vectors.astype(np.float64) * queries.astype(np.float64)[:, None, :]).sum(axis=-1)


def best_first(scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions of one query's hits, best score first, equal scores by row."""
    return np.lexsort((rows, -scores))


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The rows of the k best of one query's scores over the whole corpus (a score per row), best first,
    equal scores by row: among passages tied at the k-th score, the first in the corpus are kept."""
    k = min(k, scores.shape[0])
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
    above = np.flatnonzero(scores > kth)
    rows = np.concatenate([above, np.flatnonzero(scores == kth)[: k - above.size]])
    return rows[best_first(scores[rows], rows)]
