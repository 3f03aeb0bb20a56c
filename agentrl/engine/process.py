"""An engine in a process of its own, behind the same interface (agentrl/engine/__init__.py).

Why: vLLM's frontend handles every engine step's output for every running request (token ids, logprobs,
detokenisation, stats) on the event loop of the process that made the AsyncLLM. At a rollout's concurrency
that saturates the process: the output handler falls far behind the engine core, and the rollout's own
tool calls and their timers wait behind it on the same loop.
In a child process the engine's frontend has a core to itself and the rollout's loop stays free for tools;
several children (each vLLM one with its own engine core, sharing a GPU or on one each) split that work.

The child starts with `env` in its environment, imports `factory` ("module:name", or a class or
module-level function, passed by name), makes the engine with `factory(**kwargs)` and serves calls
concurrently. Like any spawned process it first re-imports the caller's main module, so a script that
makes engines needs an `if __name__ == "__main__":` guard. Messages are pickled frames, each headed by its
length and its call's id, over a Unix socket, written and read by asyncio streams on both sides, so neither
side can block the other (process_child.py is the child's side). Weights cross as safetensors bytes,
bucket by bucket: a `BucketReceiver` (engine/weights.py; VLLMEngine) takes them as they are; any other gets
them through `update_weights`, one bucket at a time. A vLLM engine on this process's GPU maps them by CUDA
IPC instead (`update_weights_on_gpu`): only a handle per bucket crosses the socket.

Behaviour: an error raised in the child is raised again in the caller (the child's traceback as a note);
a call cancelled here is cancelled there; if the child dies, every waiting call fails with its exit code
(an engine that raises EngineDied, as vLLM's does when its engine core died, ends the child: exit code 75);
`aclose()` closes the engine in the child (its error, if any, is raised) and fails whatever still waits.
The child leads a process group of its own: when it ends, anything it started that still runs (vLLM's
engine core, after the child was killed) is ended with it, so a restarted engine finds its GPU memory free.
An engine belongs to the event loop that first used it. Without `aclose()`, the child is ended at
interpreter exit (or when the object is collected): its socket closes, it closes its engine and exits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.engine import Completion, Sampling, refuse_in_flight
from agentrl.engine.process_child import HEADER, child_main, frame
from agentrl.engine.weights import load_buckets, load_ipc_buckets

CLOSE_TIMEOUT_S = 120.0  # for the engine in the child to close before the process is ended
_ENV_LOCK = threading.Lock()  # os.environ holds a child's `env` only while it is spawned


class EngineClosed(RuntimeError):
    """The engine process is gone: closed, or it died."""


class ProcessEngine:
    def __init__(self, factory: str | Callable[..., Any], kwargs: dict[str, Any] | None = None, *,
                 env: dict[str, str] | None = None, start_timeout_s: float = 900.0):
        ref = factory if isinstance(factory, str) else f"{factory.__module__}:{factory.__qualname__}"
        if ":" not in ref or "<locals>" in ref:
            raise ValueError(f"engine factory {ref!r}: expected 'module:name' of a class or module-level function")
        self._ref, self._kwargs, self._env, self._start_timeout_s = ref, kwargs or {}, env or {}, start_timeout_s
        self._ids = itertools.count()
        self._closed = False  # by aclose: no restart
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        """Spawn the child and wait until its engine is made (blocking); the streams open on the first call."""
        self._dir = tempfile.mkdtemp(prefix="agentrl-engine-")
        path = os.path.join(self._dir, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.process = multiprocessing.get_context("spawn").Process(
            target=child_main, args=(path, self._ref, self._kwargs), name=f"agentrl-engine-{self._ref}")
        with _ENV_LOCK:  # in the environment the child's interpreter starts with, before any import
            saved = {k: os.environ.get(k) for k in self._env}
            os.environ.update(self._env)
            try:
                self.process.start()
            finally:
                for k, v in saved.items():
                    if v is None:
                        del os.environ[k]
                    else:
                        os.environ[k] = v
        try:
            sock = _accept(listener, self.process, self._start_timeout_s)
        except BaseException:
            _reap(self.process, self._dir, None)
            raise
        finally:
            listener.close()
        self._sock = sock
        # Ended at interpreter exit even without aclose(): registered after multiprocessing's own exit hook,
        # so it runs first (that hook joins non-daemon children, and the child exits only once this closes).
        self._finalizer = weakref.finalize(self, _reap, self.process, self._dir, sock)
        atexit.register(self._finalizer)
        try:
            _, (status, value) = _read_sync(sock, self.process, self._start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        if status != "ready":
            self._finalizer()
            raise RuntimeError(f"the engine process could not make {self._ref}") from value
        self.max_context_tokens: int | None = value
        self._loop: asyncio.AbstractEventLoop | None = None
        self._opening: asyncio.Task | None = None
        self._replies: asyncio.Task | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, tuple[str, asyncio.Future]] = {}
        self._gone: str | None = None  # why no call can be made any more
        self._generating = 0
        self._updating = 0  # update_weights / load_weight_bucket calls under way

    async def restart(self) -> None:
        """Replace a child that died with a fresh one, its engine made by the factory as at the start (its
        weights are the factory's, not the last pushed: the caller pushes them again). Calls that failed
        with the old child stay failed; `restarts` counts."""
        if self._closed or self._gone is None:
            raise RuntimeError("restart(): only an engine process that died is started again "
                               f"({'closed by aclose' if self._closed else 'it is running'})")
        atexit.unregister(self._finalizer)
        await asyncio.to_thread(self._finalizer)
        await asyncio.to_thread(self._start)
        self.restarts += 1

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        if self._updating:
            raise RuntimeError("generate() during update_weights(): generate between weight updates")
        self._generating += 1
        try:
            return await self.call("generate", list(prompt_ids), sampling, session=session)
        finally:
            self._generating -= 1

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int | None:
        """Load HF-named tensors in the child, bucket by bucket; returns how many the engine reports loaded
        (None where it reports nothing). Refused while any generate() of this engine is in flight, before
        any weight moves; generate() is refused while it runs."""
        refuse_in_flight(self._generating)
        self._updating += 1
        try:
            return await load_buckets([self], named_tensors)
        finally:
            self._updating -= 1

    async def load_weight_bucket(self, payload: bytes) -> int | None:
        """One bucket as safetensors bytes (engine/weights.py's `encode_bucket`), loaded in the child: how
        EnginePool sends one encoding to several processes. `weights_loaded()` follows the last bucket."""
        refuse_in_flight(self._generating)
        self._updating += 1
        try:
            return await self.call("_load_bucket", payload)
        finally:
            self._updating -= 1

    async def weights_loaded(self) -> None:
        await self.call("_weights_loaded")

    async def update_weights_on_gpu(self, named_tensors: Iterable[tuple[str, Any]], size: int | None = None) -> int:
        """Load HF-named CUDA tensors of this process into the child's engine on the same GPU by CUDA IPC,
        never through the host (`load_ipc_bucket` in the child, as VLLMEngine's own update does). Returns
        how many tensors. Refused while any generate() of this engine is in flight, as update_weights is."""
        refuse_in_flight(self._generating)
        self._updating += 1
        try:
            return await load_ipc_buckets(named_tensors, size,
                                          lambda handle, layout: self.call("load_ipc_bucket", handle, layout),
                                          lambda: self.call("weights_loaded"))
        finally:
            self._updating -= 1

    async def sleep(self, level: int = 1) -> None:
        await self.call("sleep", level=level)

    async def wake(self) -> None:
        await self.call("wake")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`await engine.method(*args, **kwargs)` in the child (a plain call where it is not a coroutine)."""
        await self._open()
        rid = next(self._ids)
        future = self._loop.create_future()  # type: ignore[union-attr]
        self._pending[rid] = (method, future)
        try:
            try:
                message = frame(rid, (method, args, kwargs))
            except Exception as e:
                raise TypeError(f"{method}(): its arguments cannot be sent to the engine process: {e}") from e
            self._writer.write(message)  # type: ignore[union-attr]  # buffered by the transport: never blocks the loop
            return await future
        except asyncio.CancelledError:
            if self._gone is None and (future.cancelled() or not future.done()):  # no answer came: stop it there
                self._writer.write(frame(rid, ("_cancel", (), {})))  # type: ignore[union-attr]
            raise
        finally:
            self._pending.pop(rid, None)

    async def aclose(self) -> None:
        """Close the engine in the child and end the process; calls still waiting fail with EngineClosed.
        An error from the engine's own aclose is raised here (the process is ended all the same)."""
        self._closed = True
        error: BaseException | None = None
        other_loop = self._loop is not None and self._loop is not asyncio.get_running_loop()
        if self._gone is None and self._finalizer.alive and not other_loop:  # else: the socket closes, the child ends
            try:
                await asyncio.wait_for(self.call("_close"), CLOSE_TIMEOUT_S)
            except EngineClosed:
                pass  # it died meanwhile: reaped below all the same
            except Exception as e:
                error = e
        self._fail_all("the engine process was closed (aclose)")
        if self._writer is not None and not other_loop:
            self._writer.close()
        await asyncio.to_thread(self._finalizer)
        atexit.unregister(self._finalizer)
        if error is not None:
            raise error

    async def _open(self) -> None:
        """The streams, made once on the loop of the first call (shielded: a caller cancelled meanwhile must
        not close the socket under everyone else)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._opening = loop.create_task(self._connect())
        elif loop is not self._loop:
            raise RuntimeError("this engine belongs to the event loop that first used it; make one per event loop")
        if self._gone is not None:
            raise EngineClosed(self._gone)
        await asyncio.shield(self._opening)  # type: ignore[arg-type]
        if self._gone is not None:
            raise EngineClosed(self._gone)

    async def _connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        self._replies = self._loop.create_task(self._read_replies(reader))  # type: ignore[union-attr]

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size, rid = HEADER.unpack(await reader.readexactly(HEADER.size))
                data = await reader.readexactly(size)
                method, future = self._pending.get(rid, ("?", None))
                try:
                    ok, value = pickle.loads(data)
                except Exception as e:  # e.g. a class only the child can import
                    ok, value = False, RuntimeError(f"{method}(): the engine process's answer cannot be read here: "
                                                    f"{type(e).__name__}: {e}")
                if future is not None and not future.done():
                    future.set_result(value) if ok else future.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError):
            if self._gone is None:  # not closed by aclose: the child died
                await asyncio.to_thread(self.process.join, 10)
                self._fail_all(f"the engine process exited (exit code {self.process.exitcode})")
        except Exception as e:
            self._fail_all(f"reading the engine process's answers failed: {type(e).__name__}: {e}")

    def _fail_all(self, why: str) -> None:
        self._gone = self._gone or why
        for _, future in self._pending.values():
            if not future.done() and not future.get_loop().is_closed():
                future.set_exception(EngineClosed(self._gone))


def _accept(listener: socket.socket, process: multiprocessing.process.BaseProcess, timeout_s: float) -> socket.socket:
    """The child's connection; fails at once if the child dies first."""
    listener.settimeout(0.5)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            sock, _ = listener.accept()
            sock.setblocking(True)
            return sock
        except TimeoutError:
            if not process.is_alive():
                raise RuntimeError(
                    f"the engine process exited before it connected (exit code {process.exitcode}); its stderr says "
                    "why. A script that makes engines needs an `if __name__ == '__main__':` guard (spawn re-imports it)"
                ) from None
    raise TimeoutError(f"the engine process did not connect within {timeout_s:g} s")


def _read_sync(sock: socket.socket, process: multiprocessing.process.BaseProcess, timeout_s: float) -> Any:
    """One frame, blocking (the start-up answer, read before there is an event loop)."""
    sock.settimeout(timeout_s)
    try:
        def exactly(n: int) -> bytes:
            chunks = []
            while n:
                chunk = sock.recv(min(n, 1 << 20))
                if not chunk:
                    process.join(10)
                    raise RuntimeError(f"the engine process exited while starting (exit code {process.exitcode})")
                chunks.append(chunk)
                n -= len(chunk)
            return b"".join(chunks)

        size, _ = HEADER.unpack(exactly(HEADER.size))
        return pickle.loads(exactly(size))
    except TimeoutError:
        raise TimeoutError(f"the engine process did not start its engine within {timeout_s:g} s") from None
    finally:
        sock.settimeout(None)


def _reap(process: multiprocessing.process.BaseProcess, directory: str, sock: socket.socket | None) -> None:
    """End the child: once its socket closes it closes its engine and exits; SIGTERM, then SIGKILL, if not."""
    if sock is not None:
        sock.close()
        process.join(CLOSE_TIMEOUT_S)
    for stop in (process.terminate, process.kill):
        if process.is_alive():
            stop()
            process.join(10)
    if process.pid is not None:  # what the engine started and left behind (a killed child's vLLM engine core)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)
