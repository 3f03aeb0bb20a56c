"""A worker process for code that needs a hard time limit: math-verify's sympy (rewards/verify_pool.py) and
the task's own Python tools (tools/function_pool.py).

Why a process: no signal or asyncio timeout ends a long C-level computation or a busy loop that never
yields, and SIGALRM works only in a main thread; killing the process always works. A worker is a fresh
interpreter (`python -c ...`, fork+exec: safe from a process with threads, like multiprocessing's
'spawn') that talks over two pipes with multiprocessing's `Connection` framing. Unlike
`multiprocessing.Process` it never re-imports the caller's `__main__`, so it works from any script,
notebook or `python -c` without a `__main__` guard.

The worker imports `handler` ("module:function") and the `preload` modules, says it is ready, then answers
each request with `handler(request)` until its parent closes the pipe. It ignores Ctrl-C (the parent stops
it), may be given an address-space limit, and exits when its parent dies, even by SIGKILL and even while
busy.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

READY = "ready"
_CODE = "import sys; from agentrl.worker_process import serve; serve(*sys.argv[1:])"


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def serve(recv_fd: str, send_fd: str, handler_ref: str, preload: str, memory_bytes: str) -> None:
    """The worker's side (its command line's arguments, as strings)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which stops us
    parent_pid = os.getppid()
    # Not PR_SET_PDEATHSIG: it fires when the parent's *thread* that started us ends, and pools start workers
    # from passing threads. A thread that polls the parent id sees a death within a second (a loop that
    # never releases the GIL would keep it from running: only a C extension does that).
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    if int(memory_bytes) > 0:
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (int(memory_bytes), resource.RLIM_INFINITY))
        except (ImportError, ValueError, OSError):
            pass  # no such limit here; the timeout still bounds the damage
    requests, replies = Connection(int(recv_fd), writable=False), Connection(int(send_fd), readable=False)
    module, _, name = handler_ref.partition(":")
    handler = getattr(importlib.import_module(module), name)
    for extra in filter(None, preload.split(",")):  # paid before saying ready, not by the first request
        importlib.import_module(extra)
    try:
        replies.send(READY)
        while True:
            try:
                request = requests.recv()
            except (EOFError, OSError):
                return
            replies.send(handler(request))
    except BrokenPipeError:  # the parent stopped listening: it is done with us
        return


class WorkerProcess:
    """One worker process running `handler` ("module:function") and our ends of its two pipes."""

    def __init__(self, handler: str, *, preload: tuple[str, ...] = (), memory_bytes: int = 0,
                 cwd: str | None = None) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The child must import this package even when we found it through the working directory.
        package_root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        args = [str(to_child_r), str(from_child_w), handler, ",".join(preload), str(memory_bytes)]
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CODE, *args], pass_fds=(to_child_r, from_child_w),
                                         stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self.requests = Connection(to_child_w, readable=False)
        self.replies = Connection(from_child_r, writable=False)
        self.ready = False

    def wait_ready(self, timeout_s: float, what: str) -> None:
        """Block until the worker said it is ready. TimeoutError past `timeout_s`; EOFError if it died."""
        if self.ready:
            return
        if not self.replies.poll(timeout_s):
            raise TimeoutError(f"{what} worker did not start within {timeout_s:g} s")
        said = self.replies.recv()
        if said != READY:
            raise RuntimeError(f"{what} worker said {said!r} instead of {READY!r}")
        self.ready = True

    def send(self, request: Any) -> None:
        self.requests.send(request)

    def receive(self) -> Any:
        return self.replies.recv()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, kill: bool = False) -> None:
        """End the worker: at once (`kill`), or by closing its pipe (an idle worker returns)."""
        if kill:
            self.proc.kill()
        self.requests.close()
        self.replies.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
