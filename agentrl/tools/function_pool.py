"""The worker processes that run the task's Python function tools (functions.py).

Each worker (agentrl/worker_process.py) imports the functions it is asked for, once each, and runs one call
at a time: a sync function as it is, an async one in an event loop of the worker's own. A call waits for a
free worker; its answer is awaited on the caller's event loop, which stays free meanwhile. A call past its
timeout, or cancelled, kills its worker (the only way to end code that ignores time limits: a busy loop,
a C extension holding the GIL); a worker that died is replaced before the next call takes it.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import traceback
from dataclasses import dataclass, field
from typing import Any

from agentrl.tools.functions import load_function, observation
from agentrl.worker_process import READY, WorkerProcess

STARTUP_TIMEOUT_S = 60.0  # a fresh worker's interpreter and imports, not charged to the call
_functions: dict[str, Any] = {}  # in a worker: the functions imported so far
_loop: asyncio.AbstractEventLoop | None = None  # in a worker: where async functions run


@dataclass
class Answer:
    text: str
    error: str | None = None
    value: Any = None  # what the function returned, where asked for as a value
    metadata: dict[str, Any] = field(default_factory=dict)


def handle(request: tuple[str, dict[str, Any], bool]) -> tuple[str, Any]:
    """In a worker: run one call, `(ref, kwargs, as_text)`, and answer ("ok", what the model sees; with
    `as_text` false, the value itself) or (error kind, text)."""
    global _loop
    ref, kwargs, as_text = request
    try:
        fn = _functions.get(ref) or _functions.setdefault(ref, load_function(ref))
        value = fn(**kwargs)
        if asyncio.iscoroutine(value):
            _loop = _loop or asyncio.new_event_loop()
            value = _loop.run_until_complete(value)
    except Exception as e:  # the function failed: the model sees why, as for a failed program
        return "tool_error", f"Error: {''.join(traceback.format_exception_only(type(e), e)).strip()}"
    try:
        return "ok", observation(value) if as_text else json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        return "bad_response", f"Error: the tool returned a {type(value).__name__}, not text or a JSON value ({e})"


async def _reply(worker: WorkerProcess, timeout_s: float) -> Any:
    """The worker's next message, awaited on this event loop; TimeoutError past `timeout_s`, EOFError if it
    died."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = worker.replies.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout_s)
    finally:
        loop.remove_reader(fd)
    return worker.receive()


class FunctionPool:
    """`workers` processes running function-tool calls; `call()` never raises for what a call did."""

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"a function pool needs at least one worker, got {workers}")
        self.size = workers
        self._idle: asyncio.Queue[WorkerProcess] | None = None  # made on first use, in the caller's event loop
        self.restarts = 0  # workers replaced after a timeout, a cancellation or a death

    def _start(self) -> None:
        self._idle = asyncio.Queue()
        for _ in range(self.size):  # started together: their imports overlap
            self._idle.put_nowait(WorkerProcess("agentrl.tools.function_pool:handle"))

    def _replace(self, worker: WorkerProcess) -> WorkerProcess:
        worker.stop(kill=True)
        self.restarts += 1
        return WorkerProcess("agentrl.tools.function_pool:handle")

    async def call(self, ref: str, kwargs: dict[str, Any], timeout_s: float, as_text: bool = True) -> Answer:
        """`ref`'s function called with `kwargs` in a worker: its answer as text (as the model sees it), or
        with `as_text` false the JSON value it returned (in `value`)."""
        if self._idle is None:
            self._start()
        idle = self._idle
        worker = await idle.get()
        if not worker.alive:  # died since its last call
            worker = self._replace(worker)
        keep = False
        try:
            if not worker.ready:
                if await _reply(worker, STARTUP_TIMEOUT_S) != READY:
                    raise EOFError("the worker did not say it was ready")
                worker.ready = True
            worker.send((ref, kwargs, as_text))
            kind, value = await _reply(worker, timeout_s)
            keep = True
            if kind != "ok":
                return Answer(value, kind)
            return Answer(value) if as_text else Answer("", value=value)
        except TimeoutError:
            return Answer(f"Error: the tool did not finish within {timeout_s:g} s; it was stopped", "timeout")
        except (EOFError, OSError) as e:  # the worker died (a crash, os._exit, out of memory)
            try:
                code = await asyncio.to_thread(worker.proc.wait, 5)
            except subprocess.TimeoutExpired:
                code = None
            return Answer(f"Error: the tool's worker process died (exit code {code}): {type(e).__name__}",
                          "exception")
        finally:  # a worker that did not answer may still be running the call: never reused
            if self._idle is not idle:  # the pool was closed meanwhile
                worker.stop(kill=not keep)
            else:
                idle.put_nowait(worker if keep else self._replace(worker))

    def close(self) -> None:
        """End the workers (idle ones; busy ones are ended when their call returns). Closing twice is fine."""
        idle, self._idle = self._idle, None
        while idle is not None and not idle.empty():
            idle.get_nowait().stop()
