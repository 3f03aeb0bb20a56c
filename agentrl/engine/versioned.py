"""The rollout's engine as the trainer sees it: which policy version sampled each token, and weight updates
that wait only for a token boundary.

`VersionedEngine` wraps any engine. Its `version` is the policy version of the weights it holds, set by each
weight update made through `update(push, version)` (the trainer's: the learner's steps so far);
every completion says which version sampled which of its tokens (`Completion.versions`: runs of (tokens,
version)), and rollout.py turns each run into a model segment of its own, tagged with its version.

With `chunk_tokens` set (asynchronous training), a generate call runs as a sequence of engine requests of
at most that many new tokens each, every one continuing from the ids sampled so far (the engine's prefix
cache holds them). An update waits until no request is in flight, then runs while new requests wait; the
trajectories in flight then continue from the ids and logprobs they had, sampled by the new weights from
there on (a partial rollout). A stop string that spans two requests is found here, on the decoded ids, and
the completion ends at the token that completes it, as it would have within one request. Without
`chunk_tokens` (synchronous training) each generate is one engine request and updates run between rollouts.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from agentrl.engine import Completion, Sampling, completed_stop
from agentrl.engine.process import EngineClosed


class VersionedEngine:
    def __init__(self, engine: Any, tokenizer: Any, chunk_tokens: int | None = None, version: int = 0,
                 timeout_s: float | None = None, revive: Callable[[], Awaitable[None]] | None = None) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1 (or None: no chunks), got {chunk_tokens}")
        self.engine, self.tokenizer, self.chunk_tokens = engine, tokenizer, chunk_tokens
        self.timeout_s = timeout_s  # for one engine request: past it, an error naming the engine
        # A dead engine process (EngineClosed) started again with the learner's weights; the requests it
        # failed are sent again, continuing from the ids they had. None: the error is raised.
        self.revive = revive
        self._revivals = 0
        self._reviving = asyncio.Lock()
        self.version = version
        self.max_context_tokens = getattr(engine, "max_context_tokens", None)
        self._in_flight = 0
        self._updating = False
        self._changed = asyncio.Condition()
        self.stats = {"paused_requests": 0}
        # The latest update's drain: how many requests it found in flight and how long it waited for them.
        self.last_drain = {"requests": 0, "wait_s": 0.0}

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[tuple[int, int]] = []
        chunk = self.chunk_tokens or sampling.max_tokens
        part = 0
        while True:
            left = sampling.max_tokens - len(ids)
            request = sampling.with_(max_tokens=min(chunk, left))
            if part and sampling.seed is not None:  # each request its own draws, reproducibly
                request = request.with_(seed=zlib.crc32(f"{sampling.seed}/{part}".encode()))
            c, version = await self._request(prompt_ids + ids, request, session)
            new, new_logprobs = list(c.token_ids), list(c.logprobs)
            finish, stop_str = c.finish_reason, c.stop_str
            if part and sampling.stop:
                cut = self._spanning_stop(ids, new, sampling.stop)
                if cut is not None:
                    new, new_logprobs = new[: cut[0]], new_logprobs[: cut[0]]
                    finish, stop_str = "stop", cut[1]
            if new:
                ids += new
                logprobs += new_logprobs
                if versions and versions[-1][1] == version:
                    versions[-1] = (versions[-1][0] + len(new), version)
                else:
                    versions.append((len(new), version))
            part += 1
            # done: a stop, the budget, or an engine that gave fewer tokens than asked (its context is full)
            if finish == "stop" or len(ids) >= sampling.max_tokens or len(new) < request.max_tokens:
                reason = "stop" if finish == "stop" else "length"
                return Completion(ids, logprobs, reason, stop_str, versions=versions)

    async def _request(self, ids: list[int], sampling: Sampling, session: str | None) -> tuple[Completion, int]:
        async with self._changed:
            if self._updating:
                self.stats["paused_requests"] += 1
            await self._changed.wait_for(lambda: not self._updating)
            self._in_flight += 1
            version = self.version
        try:
            while True:
                revivals = self._revivals
                try:
                    return await asyncio.wait_for(self.engine.generate(ids, sampling, session=session),
                                                  self.timeout_s), version
                except EngineClosed:
                    if self.revive is None:
                        raise
                await self._revive_once(revivals)
        except TimeoutError:
            raise RuntimeError(f"the engine ({type(self.engine).__name__}) did not answer a request within "
                               f"{self.timeout_s:g} s (engine.request_timeout_s)") from None
        finally:
            async with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def _spanning_stop(self, before: list[int], new: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        """(tokens of `new` to keep, the stop string) where a stop string that began before this request
        ends in one of its first tokens (a stop string of k characters spans at most k tokens)."""
        for j in range(min(len(new), max(map(len, stops)))):
            stop = completed_stop(self.tokenizer, before + new[: j + 1], stops)
            if stop is not None:
                return j + 1, stop
        return None

    async def control(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()`, an engine call besides generation (sleep, wake, a weight push); where the engine process
        died, it is revived as for requests and the call made again."""
        while True:
            revivals = self._revivals
            try:
                return await call()
            except EngineClosed:
                if self.revive is None:
                    raise
            await self._revive_once(revivals)

    async def _revive_once(self, revivals: int) -> None:
        """The first caller to see the engine dead revives it; those that saw the same death wait, then retry."""
        async with self._reviving:
            if self._revivals == revivals:
                await self.revive()
                self._revivals += 1

    async def update(self, push: Any, version: int | None = None) -> Any:
        """Run `push()` (an async weight update of the engine) once no request is in flight, holding new ones
        until it is done; then the engine holds `version` (default: one more). Returns what `push` returned.
        `last_drain` says how many requests it waited for, and for how long."""
        start = time.perf_counter()
        async with self._changed:
            if self._updating:
                raise RuntimeError("update() while another update runs: one update at a time")
            self._updating = True
            drained = self._in_flight
            await self._changed.wait_for(lambda: self._in_flight == 0)
        self.last_drain = {"requests": drained, "wait_s": time.perf_counter() - start}
        try:
            return await self.control(push)
        finally:
            async with self._changed:
                self.version = self.version + 1 if version is None else version
                self._updating = False
                self._changed.notify_all()
