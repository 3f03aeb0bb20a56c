"""An engine in a process of its own, behind the same interface (agentrl/engine/__init__.py).

Why: vLLM's frontend handles every engine step's output for every running request (token ids, logprobs,
detokenisation, stats) on the event loop of the process that made the AsyncLLM. At a rollout's concurrency
that saturates the process (BENCHMARKS.md, rollout run 8): the output handler ran up to seconds behind the
engine core, and the rollout's own 100 ms tool calls took up to 1.4 s, their timers waiting for the loop.
In a child process the engine's frontend has a core to itself and the rollout's loop stays free for tools;
several children (each vLLM one with its own engine core, sharing a GPU or on one each) split that work.

The child imports `factory` ("module:name", or a class / module-level function, which is passed by name)
after applying `env` (so CUDA_VISIBLE_DEVICES holds before anything touches CUDA), makes the engine with
`factory(**kwargs)` and serves calls concurrently. Messages are pickled frames with a length prefix over a
Unix socket, written and read by asyncio streams on both sides, so neither side can block the other. An
error raised in the child is raised again in the caller (with the child's traceback as a note); a call
cancelled here is cancelled there; if the child dies, every waiting call fails with its exit code.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import itertools
import multiprocessing
import os
import pickle
import shutil
import socket
import struct
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from agentrl.engine import Completion, Sampling, bucket_by_bytes

_HEADER = struct.Struct("!Q")
BUCKET_BYTES = 256 << 20  # weights cross to the child in pickled buckets of about this size


class ProcessEngine:
    def __init__(self, factory: str | Callable[..., Any], kwargs: dict[str, Any] | None = None, *,
                 env: dict[str, str] | None = None, start_timeout_s: float = 900.0):
        ref = factory if isinstance(factory, str) else f"{factory.__module__}:{factory.__qualname__}"
        if ":" not in ref or "<locals>" in ref:
            raise ValueError(f"engine factory {ref!r}: expected 'module:name' of a class or module-level function")
        self._dir = tempfile.mkdtemp(prefix="agentrl-engine-")
        path = os.path.join(self._dir, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self.process = multiprocessing.get_context("spawn").Process(
            target=_child_main, args=(path, ref, kwargs or {}, env or {}), name=f"agentrl-engine-{ref}")
        self.process.start()
        try:
            sock = _accept(listener, self.process, start_timeout_s)
        except BaseException:
            _reap(self.process, self._dir, None)
            raise
        finally:
            listener.close()
        self._sock = sock
        self._finalizer = weakref.finalize(self, _reap, self.process, self._dir, sock)
        try:
            status, value = _read_sync(sock, self.process, start_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        if status != "ready":
            self._finalizer()
            raise RuntimeError(f"the engine process could not make {ref}") from value
        self.max_context_tokens: int | None = value
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._connecting = asyncio.Lock()
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._dead: str | None = None
        self._replies: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        return await self.call("generate", list(prompt_ids), sampling, session=session)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int | None:
        """Send the tensors to the child bucket by bucket (on the CPU) and load each there; returns how many
        the engine reports loaded (None where it reports nothing)."""
        total: int | None = None
        for bucket in bucket_by_bytes(named_tensors, BUCKET_BYTES):
            count = await self.call("update_weights", [(n, t.detach().to("cpu")) for n, t in bucket])
            if count is not None:
                total = (total or 0) + count
        return total

    async def sleep(self, level: int = 1) -> None:
        await self.call("sleep", level=level)

    async def wake(self) -> None:
        await self.call("wake")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`await engine.method(*args, **kwargs)` in the child (a plain call where it is not a coroutine)."""
        await self._connect()
        if self._dead:
            raise RuntimeError(self._dead)
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        self._send((rid, method, args, kwargs))
        try:
            return await future
        except asyncio.CancelledError:
            if not self._dead:
                self._send((rid, "_cancel", (), {}))
            raise
        finally:
            self._pending.pop(rid, None)

    async def aclose(self) -> None:
        """Close the engine in the child, then end the process."""
        if self._finalizer.alive and not self._dead:
            try:
                await self.call("_close")
            except RuntimeError:
                pass  # it died meanwhile: reaped below all the same
        if self._writer is not None:
            self._writer.close()
        if self._replies is not None:
            self._replies.cancel()
        await asyncio.to_thread(self._finalizer)

    def _send(self, message: tuple) -> None:
        assert self._writer is not None
        self._writer.write(_frame(message))  # buffered by the transport; never blocks the loop

    async def _connect(self) -> None:
        async with self._connecting:
            if self._writer is None and not self._dead:
                self._reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
                self._replies = asyncio.create_task(self._read_replies())

    async def _read_replies(self) -> None:
        assert self._reader is not None
        try:
            while True:
                rid, ok, value = await _read(self._reader)
                future = self._pending.get(rid)
                if future is not None and not future.done():
                    future.set_result(value) if ok else future.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError):
            await asyncio.to_thread(self.process.join, 10)
            self._dead = f"the engine process exited (exit code {self.process.exitcode})"
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(RuntimeError(self._dead))


def _frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


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
                raise RuntimeError(f"the engine process exited before it connected (exit code {process.exitcode})") from None
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

        (size,) = _HEADER.unpack(exactly(_HEADER.size))
        return pickle.loads(exactly(size))
    except TimeoutError:
        raise TimeoutError(f"the engine process did not start its engine within {timeout_s:g} s") from None
    finally:
        sock.settimeout(None)


def _reap(process: multiprocessing.process.BaseProcess, directory: str, sock: socket.socket | None) -> None:
    """End the child (it closes its engine and exits once its socket closes) and remove the socket's directory."""
    if sock is not None:
        sock.close()
    process.join(30 if sock is not None else 0)
    if process.is_alive():
        process.kill()
        process.join()
    shutil.rmtree(directory, ignore_errors=True)


def _portable(error: BaseException) -> BaseException:
    """`error` with the child's traceback as a note, or a RuntimeError saying the same where it cannot be
    pickled."""
    tb = "".join(traceback.format_exception(error))
    try:
        error.add_note(f"raised in the engine process:\n{tb}")
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"in the engine process: {type(error).__name__}: {error}\n{tb}")


def _child_main(path: str, ref: str, kwargs: dict[str, Any], env: dict[str, str]) -> None:
    os.environ.update(env)
    asyncio.run(_serve(path, ref, kwargs))


async def _serve(path: str, ref: str, kwargs: dict[str, Any]) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        module, name = ref.split(":", 1)
        factory = importlib.import_module(module)
        for part in name.split("."):
            factory = getattr(factory, part)
        engine = factory(**kwargs)
    except Exception as e:
        writer.write(_frame(("failed", _portable(e))))
        await writer.drain()
        return
    writer.write(_frame(("ready", getattr(engine, "max_context_tokens", None))))
    tasks: dict[int, asyncio.Task] = {}

    async def run(rid: int, method: str, args: tuple, kw: dict) -> None:
        try:
            if method.startswith("_") or not callable(getattr(engine, method, None)):
                raise AttributeError(f"{type(engine).__name__} has no method {method!r}")
            result = getattr(engine, method)(*args, **kw)
            reply = (rid, True, await result if inspect.isawaitable(result) else result)
        except asyncio.CancelledError:
            return  # the caller has stopped waiting
        except Exception as e:
            reply = (rid, False, _portable(e))
        finally:
            tasks.pop(rid, None)
        try:
            writer.write(_frame(reply))
        except Exception as e:  # an answer that cannot be pickled
            writer.write(_frame((rid, False, _portable(e))))

    try:
        while True:
            try:
                rid, method, args, kw = await _read(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # the parent is gone
            if method == "_cancel":
                if rid in tasks:
                    tasks[rid].cancel()
            elif method == "_close":
                break
            else:
                tasks[rid] = asyncio.create_task(run(rid, method, args, kw))
    finally:
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        if inspect.iscoroutinefunction(getattr(engine, "aclose", None)):
            await engine.aclose()
    writer.write(_frame((rid, True, None)))  # the answer to _close
    await writer.drain()
    writer.close()
