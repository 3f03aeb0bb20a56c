"""The worker processes that run the task's Python function tools (functions.py).

Each worker is a spawned process that imports the functions it is asked for (once each) and runs one call
at a time: a sync function as it is, an async one in an event loop of the worker's own. A call waits for a
free worker; its answer comes back over a pipe, read without blocking the caller's event loop. A call past
its timeout, or cancelled, kills its worker (the only way to end code that ignores time limits, a busy
loop or a C extension holding the GIL); a worker that died is replaced before the next call takes it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from agentrl.tools.functions import load_function, observation


@dataclass
class Answer:
    text: str
    error: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _worker_main(conn: Connection, cwd: str) -> None:
    """Answer (ref, kwargs) calls with ("ok", text) or (error kind, text) until the pipe closes."""
    os.chdir(cwd)  # file refs are relative to the trainer's working directory
    functions: dict[str, Any] = {}
    loop = None
    while True:
        try:
            ref, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = functions.get(ref) or functions.setdefault(ref, load_function(ref))
            value = fn(**kwargs)
            if asyncio.iscoroutine(value):
                loop = loop or asyncio.new_event_loop()
                value = loop.run_until_complete(value)
        except Exception as e:  # the function failed: the model sees why, as for a failed program
            lines = traceback.format_exception_only(type(e), e)
            conn.send(("tool_error", f"Error: {''.join(lines).strip()}"))
            continue
        try:
            conn.send(("ok", observation(value)))
        except (TypeError, ValueError) as e:
            conn.send(("bad_response", f"Error: the tool returned a {type(value).__name__}, not text or a JSON "
                                       f"value ({e})"))


class _Worker:
    def __init__(self) -> None:
        ours, theirs = multiprocessing.get_context("spawn").Pipe()
        self.conn = ours
        self.process = multiprocessing.get_context("spawn").Process(
            target=_worker_main, args=(theirs, os.getcwd()), name="agentrl-tool-worker", daemon=True)
        self.process.start()
        theirs.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()


async def _readable(conn: Connection, timeout_s: float) -> bool:
    """Whether `conn` has something to read (an answer, or the end of a dead worker) within `timeout_s`."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
    try:
        return await asyncio.wait_for(ready, timeout_s)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)


class FunctionPool:
    """`workers` processes running function-tool calls; `call()` never raises for what a call did."""

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"a function pool needs at least one worker, got {workers}")
        self.size = workers
        self._idle: asyncio.Queue[_Worker] | None = None  # made on first use, in the caller's event loop
        self._all: list[_Worker] = []
        self.restarts = 0  # workers replaced after a timeout, a cancellation or a crash

    def _start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self.size):
            worker = _Worker()
            self._all.append(worker)
            self._idle.put_nowait(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        self._all.remove(worker)
        self.restarts += 1
        fresh = _Worker()
        self._all.append(fresh)
        return fresh

    async def call(self, ref: str, kwargs: dict[str, Any], timeout_s: float) -> Answer:
        if self._idle is None:
            self._start()
        worker = await self._idle.get()
        if not worker.process.is_alive():  # died since its last call
            worker = self._replace(worker)
        keep = True
        try:
            worker.conn.send((ref, kwargs))
            if not await _readable(worker.conn, timeout_s):
                keep = False
                return Answer(f"Error: the tool did not finish within {timeout_s:g} s; it was stopped", "timeout")
            kind, text = worker.conn.recv()
            return Answer(text, None if kind == "ok" else kind)
        except (EOFError, OSError) as e:  # the worker died mid-call (a crash, os._exit, out of memory)
            keep = False
            code = worker.process.exitcode
            return Answer(f"Error: the tool's worker process died (exit code {code}): {type(e).__name__}",
                          "exception")
        except BaseException:  # cancelled: the call may still run there
            keep = False
            raise
        finally:
            self._idle.put_nowait(worker if keep else self._replace(worker))

    def close(self) -> None:
        for worker in self._all:
            worker.kill()
        self._all.clear()
        self._idle = None
