"""The engine process's side of process.py: it makes the engine, then answers the parent's calls.

Messages are pickled frames (`frame`), each headed by its length and its call's id (HEADER), over the Unix
socket the parent listens on. Every call runs as a task of its own and is answered when it ends; a call the
parent cancels is cancelled here and gets no answer; an error goes back with this process's traceback as a
note (`_portable`). When the parent closes the engine, or goes, the calls still running are ended and the
engine is closed.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import struct
import sys
import traceback
from typing import Any

from agentrl.engine import EngineDied, maybe_await
from agentrl.engine.weights import load_bucket, weights_loaded

HEADER = struct.Struct("!QQ")  # payload bytes, call id
DIED_EXIT_CODE = 75  # the engine raised EngineDied


def frame(rid: int, message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data), rid) + data


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


def child_main(path: str, ref: str, kwargs: dict[str, Any]) -> None:
    os.setpgrp()  # a process group of its own: the parent ends what the engine started (vLLM's engine core) with it
    asyncio.run(_serve(path, ref, kwargs))


async def _serve(path: str, ref: str, kwargs: dict[str, Any]) -> None:
    """Make the engine and say so (or why not), then answer calls until the parent closes it or goes."""
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        module, name = ref.split(":", 1)
        factory = importlib.import_module(module)
        for part in name.split("."):
            factory = getattr(factory, part)
        child = _Child(factory(**kwargs), writer)
    except Exception as e:
        _reply(writer, 0, True, ("failed", _portable(e)))
        await writer.drain()
        return
    _reply(writer, 0, True, ("ready", getattr(child.engine, "max_context_tokens", None)))
    close_rid = None
    try:
        close_rid = await child.serve(reader)
    finally:
        await child.close(close_rid)


def _reply(writer: asyncio.StreamWriter, rid: int, ok: bool, value: Any) -> None:
    try:
        writer.write(frame(rid, (ok, value)))
    except Exception as e:  # an answer that cannot be pickled
        writer.write(frame(rid, (False, _portable(e))))


class _Child:
    """The engine process's side: every call runs as a task of its own and is answered when it ends."""

    def __init__(self, engine: Any, writer: asyncio.StreamWriter) -> None:
        self.engine, self.writer = engine, writer
        self.tasks: dict[int, asyncio.Task] = {}
        self.cancelled: set[int] = set()  # calls the parent cancelled: they get no answer

    async def serve(self, reader: asyncio.StreamReader) -> int | None:
        """Start each call as it arrives; returns the id of the close call (None: the parent is gone)."""
        while True:
            try:
                size, rid = HEADER.unpack(await reader.readexactly(HEADER.size))
                method, args, kw = pickle.loads(await reader.readexactly(size))
            except (asyncio.IncompleteReadError, ConnectionError):
                return None  # the parent is gone: close the engine all the same
            if method == "_cancel":
                self.cancelled.add(rid)
                if rid in self.tasks:
                    self.tasks[rid].cancel()
            elif method == "_close":
                return rid
            else:
                task = self.tasks[rid] = asyncio.create_task(self.run(rid, method, args, kw))
                task.add_done_callback(lambda _, rid=rid: (self.tasks.pop(rid, None), self.cancelled.discard(rid)))

    async def run(self, rid: int, method: str, args: tuple, kw: dict) -> None:
        try:
            if method == "_load_bucket":  # bytes as they are, or as tensors (engine/weights.py)
                result = await load_bucket(self.engine, *args)
            elif method == "_weights_loaded":
                result = await weights_loaded(self.engine)
            elif method == "_tasks":  # for tests: the calls still running here
                result = len(self.tasks) - 1
            elif method.startswith("_") or not callable(getattr(self.engine, method, None)):
                raise AttributeError(f"{type(self.engine).__name__} has no method {method!r}")
            else:
                result = await maybe_await(getattr(self.engine, method)(*args, **kw))
            _reply(self.writer, rid, True, result)
        except asyncio.CancelledError:
            if rid not in self.cancelled:  # cancelled inside the engine, not by the caller: an error there
                _reply(self.writer, rid, False, RuntimeError(f"{method}() was cancelled inside the engine process"))
        except EngineDied as e:  # the engine is gone: so is this process, and the parent starts another
            print(f"agentrl engine process: {e}; exiting", file=sys.stderr, flush=True)
            os._exit(DIED_EXIT_CODE)
        except Exception as e:
            _reply(self.writer, rid, False, _portable(e))

    async def close(self, close_rid: int | None) -> None:
        """End the calls still running, close the engine, answer the close call (with the engine's error)."""
        self.cancelled.update(self.tasks)
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        close = getattr(self.engine, "aclose", None)
        try:
            if callable(close):
                await maybe_await(close())
            closed: tuple[bool, Any] = (True, None)
        except Exception as e:
            closed = (False, _portable(e))
        if close_rid is not None:
            _reply(self.writer, close_rid, *closed)
            await self.writer.drain()
        self.writer.close()
