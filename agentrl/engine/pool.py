"""Several engines behind the one Engine interface: a trajectory's turns all go to the same engine, chosen by
its session key (its earlier turns are in that engine's prefix cache); weights go to all of them.

Why several engines on one GPU: vLLM's frontend (detokenising, stop strings, logprobs, the output queues of
every running request) is one Python event loop per engine. At a rollout's concurrency it saturates its
core and falls behind the engine core, and a multi-turn loop pays that lag at every turn. Two engines on
the GPU, each in a process of its own (process.py), split that work, and the async loop then keeps close to
plain generation's throughput where one such engine does not (BENCHMARKS.md).
`vllm.vllm_processes` makes such a pool; any engines can be pooled (the tests pool transformers engines).

A session always maps to the same engine (crc32 of the key), so routing needs no state; requests without a
session go round the engines in turn. The rollout's key is per trajectory, so the samples of one prompt
spread over the engines (each engine then prefills that prompt once): that balances the engines' load.

Weights: `update_weights` is refused while any request routed through the pool runs, before any weight
moves, and `generate` is refused while it runs. Each bucket goes to all engines at once (engine/__init__.py's
`load_buckets`), encoded once for those that take safetensors buckets (VLLMEngine and ProcessEngine do). If
an update fails or is cancelled part-way, the engines may hold a mix of old and new weights: the error is
raised, and `generate` is refused until a later update succeeds (conservatively: also where nothing had
moved yet; and any successful update clears it, so it should send every weight).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from agentrl.engine import Completion, Sampling, on_each, raise_first, refuse_in_flight
from agentrl.engine.weights import load_buckets


class EnginePool:
    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("an EnginePool needs at least one engine")
        self.engines = list(engines)
        limits = [x for e in self.engines if (x := getattr(e, "max_context_tokens", None)) is not None]
        self.max_context_tokens: int | None = min(limits) if limits else None
        self._turn = itertools.count()
        self._generating = 0
        self._updating = False
        self._mixed: str | None = None  # why the engines' weights are not one model's (a failed update)

    def pick(self, session: str | None) -> Any:
        """The engine for `session`: always the same one for a key; round-robin without one."""
        if session is None:
            return self.engines[next(self._turn) % len(self.engines)]
        return self.engines[zlib.crc32(session.encode()) % len(self.engines)]

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        if self._updating:
            raise RuntimeError("generate() during update_weights(): generate between weight updates")
        if self._mixed is not None:
            raise RuntimeError(f"the engines hold a mix of old and new weights ({self._mixed}): update them again")
        self._generating += 1
        try:
            return await self.pick(session).generate(prompt_ids, sampling, session=session)
        finally:
            self._generating -= 1

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int | None:
        """Every engine gets every tensor; returns how many the first engine reports loaded (None where it
        reports nothing)."""
        refuse_in_flight(self._generating)
        if self._updating:
            raise RuntimeError("update_weights() while another update runs: one update at a time")
        self._updating = True
        try:
            total = await load_buckets(self.engines, named_tensors)
        except BaseException as e:
            self._mixed = f"update_weights() failed: {type(e).__name__}: {e}"
            raise
        finally:
            self._updating = False
        self._mixed = None
        return total

    async def sleep(self, level: int = 1) -> None:
        """Every engine's sleep (engines without one, such as HFEngine, fail with AttributeError)."""
        raise_first(await on_each(self.engines, lambda e: e.sleep(level)))

    async def wake(self) -> None:
        raise_first(await on_each(self.engines, lambda e: e.wake()))

    async def aclose(self) -> None:
        """Close every engine, even when one fails to; the first failure is raised after, the others noted on it."""
        raise_first(await on_each(self.engines, lambda e: e.aclose()))
