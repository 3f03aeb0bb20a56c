"""Several engines behind the one Engine interface: a trajectory's turns all go to the same engine, chosen by
its session key (its earlier turns are in that engine's prefix cache); weights go to all of them.

Why several engines on one GPU: vLLM's frontend (detokenising, stop strings, logprobs, the output queues of
every running request) is one Python event loop per engine. At a rollout's concurrency it saturates its
core and falls behind the engine core, and a multi-turn loop pays that lag at every turn (BENCHMARKS.md,
rollout runs 8 and 9). Two engines, each in a process of its own (process.py), halve every frontend's load:
on one H200 the async loop went from 0.80x plain generation to 0.94x. `vllm.vllm_processes` makes such a
pool; any engines can be pooled (the tests pool transformers engines).

A session always maps to the same engine (crc32 of the key), so routing needs no state and survives
restarts; requests without a session go round the engines in turn. `update_weights` encodes each bucket
once and loads it into every engine at once where they take safetensors buckets (VLLMEngine and
ProcessEngine do; engine/__init__.py's `load_buckets`), else hands each engine each bucket.
"""

from __future__ import annotations

import asyncio
import itertools
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from agentrl.engine import Completion, Sampling, bucket_by_bytes, load_buckets, takes_buckets
from agentrl.engine.process import maybe_await


class EnginePool:
    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self.engines = list(engines)
        limits = [e.max_context_tokens for e in self.engines if e.max_context_tokens is not None]
        self.max_context_tokens: int | None = min(limits) if limits else None
        self._turn = itertools.count()

    def pick(self, session: str | None) -> Any:
        """The engine for `session`: always the same one for a key; round-robin without one."""
        if session is None:
            return self.engines[next(self._turn) % len(self.engines)]
        return self.engines[zlib.crc32(session.encode()) % len(self.engines)]

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        return await self.pick(session).generate(prompt_ids, sampling, session=session)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int | None:
        """Every engine gets every tensor; returns how many the first engine reports loaded (None where it
        reports nothing). Call it between rollouts, as for one engine."""
        if all(takes_buckets(e) for e in self.engines):
            return await load_buckets(self.engines, named_tensors)
        total: int | None = None
        for bucket in bucket_by_bytes(named_tensors):
            counts = await asyncio.gather(*(e.update_weights(bucket) for e in self.engines))
            if counts[0] is not None:
                total = (total or 0) + counts[0]
        return total

    async def sleep(self, level: int = 1) -> None:
        await asyncio.gather(*(e.sleep(level) for e in self.engines))

    async def wake(self) -> None:
        await asyncio.gather(*(e.wake() for e in self.engines))

    async def aclose(self) -> None:
        """Close every engine, even when one fails to; the first failure is raised after."""
        results = await asyncio.gather(*(maybe_await(e.aclose()) for e in self.engines), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
