"""The pool of run workers: one run at a time per worker, a bounded queue in front.

`WorkerPool` holds the run workers (worker.Zygote): a request takes an idle worker or waits in a queue of
at most `max_queue` for up to `queue_timeout_s` (full or too long -> `Overloaded`, which server.py turns
into 503); how long requests waited is kept for /health. A dead worker is replaced in the background.
run.py drives one run on a worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from sandbox.cgroups import CgroupSet
from sandbox.run import Job, Outcome, execute
from sandbox.settings import Settings
from sandbox.worker import Zygote

# Runs handed again to a fresh supervisor when one failed to set itself up before the program started.
SETUP_RETRIES = 2

log = logging.getLogger("sandbox.pool")


class Overloaded(Exception):
    """Every worker is busy and the queue is full (or waiting took too long)."""


WAIT_SAMPLES = 1000  # /health's queue-wait figures cover this many of the latest requests


class WorkerPool:
    def __init__(self, settings: Settings, cgroups: CgroupSet | None, uid_base: int) -> None:
        self.settings = settings
        self.cgroups = cgroups
        self.uid_base = uid_base
        self.workers: list[Zygote] = []
        self.idle: asyncio.Queue[Zygote] = asyncio.Queue()
        self.waiting = 0
        self._waiting_since: dict[int, float] = {}  # per queued request: when it started waiting
        self._waits: deque[float] = deque(maxlen=WAIT_SAMPLES)  # seconds each recent request waited
        self._max_wait = 0.0
        self._respawns: set[asyncio.Task[None]] = set()
        self._replacing: set[Zygote] = set()

    def _new(self, index: int) -> Zygote:
        worker = Zygote(f"worker{index}", self.settings.run_uid + index, self.settings, self.cgroups,
                        self.uid_base)
        worker.on_death = self._replace
        return worker

    async def start(self) -> None:
        self.workers = [self._new(i) for i in range(self.settings.workers)]
        await asyncio.gather(*(w.start(self.settings.preload, WARMUP) for w in self.workers))
        for worker in self.workers:
            self.idle.put_nowait(worker)

    async def acquire(self) -> Zygote:
        while not self.waiting and not self.idle.empty():  # fast path: a worker is free, nobody waits
            worker = self.idle.get_nowait()
            if worker.alive:
                self._waits.append(0.0)
                return worker
            self._replace(worker)
        if self.waiting >= self.settings.max_queue:
            raise Overloaded(f"{self.settings.max_queue} runs are already waiting for a worker")
        self.waiting += 1
        since = time.monotonic()
        token = id(asyncio.current_task())
        self._waiting_since[token] = since
        deadline = since + self.settings.queue_timeout_s
        try:
            while True:
                getter = asyncio.ensure_future(self.idle.get())
                try:
                    done, _ = await asyncio.wait([getter], timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.CancelledError:  # the client left while queued: keep the worker
                    self._give_back(getter)
                    raise
                if not done:
                    self._give_back(getter)
                    raise Overloaded(f"no worker became free within {self.settings.queue_timeout_s:g} s")
                worker = getter.result()
                if worker.alive:
                    return worker
                self._replace(worker)
        finally:
            self.waiting -= 1
            del self._waiting_since[token]
            waited = time.monotonic() - since
            self._waits.append(waited)
            self._max_wait = max(self._max_wait, waited)

    def _give_back(self, getter: asyncio.Future[Zygote]) -> None:
        """A queue.get() that completed as we gave up on it must not lose its worker."""
        if getter.done() and not getter.cancelled():
            self.idle.put_nowait(getter.result())
        else:
            getter.cancel()

    async def run(self, job: Job) -> Outcome:
        outcome = await execute(await self.acquire(), job, self.settings, self.release)
        for _ in range(SETUP_RETRIES):  # a pre-started supervisor failed before the program ran: afresh
            if not outcome.setup_failed:
                break
            outcome = await execute(await self.acquire(), job, self.settings, self.release)
        return outcome

    def release(self, worker: Zygote) -> None:
        if worker.alive:
            self.idle.put_nowait(worker)
        else:
            self._replace(worker)

    def _replace(self, dead: Zygote) -> None:
        # Once per dead worker: a worker that died is also found dead in the idle queue, maybe after its
        # replacement took its place.
        if dead in self._replacing or dead not in self.workers:
            return
        self._replacing.add(dead)
        task = asyncio.create_task(self._respawn(dead))
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _respawn(self, dead: Zygote) -> None:
        await dead.stop()
        index = self.workers.index(dead)
        delay = 0.5
        while True:
            fresh = self._new(index)
            try:
                await fresh.start(self.settings.preload, WARMUP)
            except asyncio.CancelledError:  # the service is stopping
                await fresh.stop()
                raise
            except Exception as e:  # noqa: BLE001 - keep trying; /health shows the worker missing
                log.error("restarting %s failed: %s", fresh.name, e)
                await fresh.stop()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self.workers[index] = fresh
            self._replacing.discard(dead)
            self.idle.put_nowait(fresh)
            return

    def status(self) -> dict[str, Any]:
        alive = sum(w.alive for w in self.workers)
        oom = sum(self.cgroups.oom_kills(w.cgroup) for w in self.workers) if self.cgroups else 0
        idle = sum(w.alive for w in self.idle._queue)  # type: ignore[attr-defined]  # dead ones wait there too
        return {"workers": len(self.workers), "alive": alive, "idle": idle,
                "queued": self.waiting, "queue_wait_s": self.queue_wait(), "oom_kills": oom}

    def queue_wait(self) -> dict[str, float | int]:
        """How long requests wait for a worker: the one waiting longest now; the median and 99th percentile
        over the latest requests (those that found a worker free count as 0); the longest since the start.
        A wait is bounded by `queue_timeout_s` (`limit`): beyond it the answer is 503."""
        now = time.monotonic()
        waits = sorted(self._waits)

        def pick(q: float) -> float:
            return round(waits[min(len(waits) - 1, int(q * len(waits)))], 4) if waits else 0.0
        return {"longest_now": round(max((now - t for t in self._waiting_since.values()), default=0.0), 4),
                "p50": pick(0.5), "p99": pick(0.99), "samples": len(waits),
                "max_since_start": round(self._max_wait, 4), "limit": self.settings.queue_timeout_s}

    async def stop(self) -> None:
        for task in list(self._respawns):
            task.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)


# Lazily imported sympy submodules (printing, simplification) pulled in once in the program forker.
WARMUP = ("import sympy; sympy.simplify(sympy.sin(sympy.Symbol('x'))**2 + sympy.cos(sympy.Symbol('x'))**2); "
          "str(sympy.Rational(1, 3) + sympy.sqrt(2))",)
