"""Dynamic batching: concurrent `/retrieve` requests merged into one encoder forward and one index search
(one per distinct topk among them).

Requests wait in an asyncio queue. One worker takes the first, then gathers whatever else arrives within
`max_wait_ms` (or until `max_batch_queries` queries) - but only while the previous batch held several
requests, so a lone client never pays the wait - runs the whole batch on a single worker thread
(`search` then the docs lookup, off the event loop, so torch and faiss release the GIL while the loop keeps
accepting requests), and hands each request its own slice, trimmed to its own topk. While a batch runs, the
next one fills up, so under load batches grow by themselves. `merge=False` serves one request at a time
through the same path: the baseline the benchmark compares against. server.py owns one of these.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Hits = list[tuple[dict[str, Any], float]]  # one query's (document, score), best first
SearchFn = Callable[[list[str], int], tuple[np.ndarray, np.ndarray]]
FetchFn = Callable[[list[int]], list[dict[str, Any]]]


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future


@dataclass
class BatchStats:
    requests: int = 0
    queries: int = 0
    batches: int = 0
    largest_batch: int = 0
    abandoned: int = 0  # requests whose client left before their batch ran (their queries are not searched)
    histogram: dict[int, int] = field(default_factory=dict)  # batch size in queries (power of two) -> count

    def record(self, n_requests: int, n_queries: int) -> None:
        self.requests += n_requests
        self.queries += n_queries
        self.batches += 1
        self.largest_batch = max(self.largest_batch, n_queries)
        bucket = 1 << max(0, n_queries - 1).bit_length()
        self.histogram[bucket] = self.histogram.get(bucket, 0) + 1


def split_hits(
    scores: np.ndarray, rows: np.ndarray, ks: list[int], counts: list[int], fetch: FetchFn
) -> list[list[Hits]]:
    """Cut one batch's (scores, rows) back into per-request, per-query hits, each trimmed to its k.
    Rows < 0 (no hit) are dropped; all documents are fetched in one call."""
    plan: list[list[tuple[int, list[int]]]] = []  # per request: (batch row, columns kept) for each query
    q = 0
    for k, n in zip(ks, counts, strict=True):
        request = []
        for _ in range(n):
            request.append((q, [c for c in range(min(k, rows.shape[1])) if rows[q, c] >= 0]))
            q += 1
        plan.append(request)
    docs = iter(fetch([int(rows[q, c]) for request in plan for q, cols in request for c in cols]))
    return [[[(next(docs), float(scores[q, c])) for c in cols] for q, cols in request] for request in plan]


class DynamicBatcher:
    def __init__(
        self, search: SearchFn, fetch: FetchFn, *, max_batch_queries: int = 256, max_wait_ms: float = 2.0, merge: bool = True
    ) -> None:
        self._search, self._fetch = search, fetch
        self._max_queries, self._max_wait, self._merge = max_batch_queries, max_wait_ms / 1000, merge
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._arrived = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")
        self._worker: asyncio.Task | None = None
        self._concurrent = False  # did the last batch merge several requests? Then waiting pays off.
        self.stats = BatchStats()

    @property
    def waiting(self) -> int:
        """Requests queued and not yet taken into a batch."""
        return self._queue.qsize()

    def describe(self) -> dict[str, Any]:
        s = self.stats
        return {
            "dynamic": self._merge, "max_batch_queries": self._max_queries, "max_wait_ms": self._max_wait * 1000,
            "requests": s.requests, "queries": s.queries, "batches": s.batches, "largest_batch": s.largest_batch,
            "abandoned": s.abandoned,
            "batch_size_histogram": {str(k): v for k, v in sorted(s.histogram.items())},
        }  # fmt: skip

    async def start(self) -> None:
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def retrieve(self, queries: list[str], k: int) -> list[Hits]:
        """Hits for each query, best first, at most k each."""
        if not queries:
            return []
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(queries, k, future))
        self._arrived.set()
        try:
            return await future
        except asyncio.CancelledError:  # the caller gave up: the worker skips the cancelled future
            self.stats.abandoned += 1
            raise

    async def _gather(self) -> list[_Pending]:
        batch = [await self._queue.get()]
        if not self._merge:
            return batch
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._max_wait if self._concurrent else 0.0)
        n = len(batch[0].queries)
        while n < self._max_queries:
            if self._queue.empty():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._arrived.clear()
                try:  # waiting on an event (not on queue.get) cannot lose an item when it times out
                    await asyncio.wait_for(self._arrived.wait(), remaining)
                except TimeoutError:  # not the builtin before Python 3.11
                    break
                continue
            item = self._queue.get_nowait()
            batch.append(item)
            n += len(item.queries)
        return batch

    def _run_batch(self, batch: list[_Pending]) -> list[list[Hits]]:
        """One search per distinct topk in the batch (one in the usual case: a rollout's requests share it).
        A search with a larger k may pick and order passages of tied scores differently (faiss does), so
        searching every request at the batch's largest k would make a request's answer depend on its
        batch-mates."""
        out: list[list[Hits]] = [[] for _ in batch]
        for k in dict.fromkeys(item.k for item in batch):
            members = [i for i, item in enumerate(batch) if item.k == k]
            scores, rows = self._search([q for i in members for q in batch[i].queries], k)
            hits = split_hits(scores, rows, [k] * len(members), [len(batch[i].queries) for i in members], self._fetch)
            for i, h in zip(members, hits, strict=True):
                out[i] = h
        return out

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._gather()
            live = [item for item in batch if not item.future.done()]  # a client that went away is skipped
            if not live:
                continue
            self._concurrent = len(batch) > 1
            self.stats.record(len(live), sum(len(item.queries) for item in live))
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, live)
            except Exception as e:  # noqa: BLE001 - the error belongs to the requests, not to the worker
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            for item, result in zip(live, results, strict=True):
                if not item.future.done():
                    item.future.set_result(result)
