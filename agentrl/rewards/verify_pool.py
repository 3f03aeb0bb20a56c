"""Worker processes for the slow part of math grading: sympy through math-verify, with a hard timeout.

math.py settles most answers in-process (equal after normalisation, or two plain numbers) and sends only
the rest here. Why processes: math-verify's own timeouts use SIGALRM, which works only in the main thread
(the trainer grades from threads and from inside asyncio loops), and no signal interrupts a long C-level
computation such as the exact integer 10^{10^{10}}. So each comparison runs in a persistent worker; the
caller waits at most `timeout_s`, and a worker that overruns is killed and a fresh one takes its slot.

A worker is a fresh interpreter (`python -c ...`, fork+exec: safe from a process with threads, like
multiprocessing's 'spawn') that talks over two pipes with multiprocessing's `Connection` framing. Unlike
`multiprocessing.Process` it never re-imports the caller's `__main__`, so grading works from any script,
notebook or `python -c` without a `__main__` guard. Workers start on first use and are reused;
`shutdown()` (also run at exit) stops them, and a worker whose parent died exits on its own.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

_log = logging.getLogger(__name__)

# A fresh worker imports sympy and math-verify (about a second; longer while several start on a busy
# machine). That wait is not the comparison's fault, so it has its own, generous, limit.
_STARTUP_TIMEOUT_S = 60.0
# Exact arithmetic on a pathological answer can eat memory faster than the timeout ends it.
_WORKER_MEMORY_BYTES = 4 << 30
_READY = "ready"
_WORKER_CODE = (
    "import sys; from agentrl.rewards.verify_pool import worker_main; worker_main(*map(int, sys.argv[1:]))"
)


def default_size() -> int:
    """Worker count: most answers never reach the pool, so a few workers serve a whole batch."""
    return max(1, min(8, os.cpu_count() or 1))


# --- inside a worker --------------------------------------------------------------------------------


def compare(pred: str, gold: str, timeout_s: float) -> bool:
    """math-verify's verdict on two answers (both wrapped in `$...$`: bare LaTeX such as `p - q` or
    `\\left( 3, \\frac{\\pi}{2} \\right)` is mis-parsed without them). Never raises. Its SIGALRM limits
    need the main thread: call this in a worker, or in the main thread of a process you may block."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    # In a worker the parent's kill is the real limit; these whole-second limits only let an ordinary
    # slow case end without costing a worker restart.
    inner = max(1, math.floor(timeout_s / 3))
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=inner)
        pred_parsed = parse(f"${pred}$", parsing_timeout=inner)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=inner))
    except (Exception, TimeoutException):  # TimeoutException derives from BaseException
        return False


def _exit_when_orphaned(parent_pid: int) -> None:
    """A worker whose parent died (even by SIGKILL) must not live on: poll the parent id."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(0)


def worker_main(recv_fd: int, send_fd: int) -> None:
    """Answer `(pred, gold, timeout_s)` requests with a bool until the parent closes the pipe."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the parent, which stops us
    parent_pid = os.getppid()
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, resource.RLIM_INFINITY))
    except (ImportError, ValueError, OSError):
        pass  # no such limit here; the timeout still bounds the damage
    requests, replies = Connection(recv_fd, writable=False), Connection(send_fd, readable=False)
    import math_verify  # noqa: F401 - pay the import before saying ready

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeout warnings are expected
    replies.send(_READY)
    while True:
        try:
            pred, gold, timeout_s = requests.recv()
        except (EOFError, OSError):
            return
        replies.send(compare(pred, gold, timeout_s))


# --- in the grading process ---------------------------------------------------------------------------


class _Worker:
    """One worker process and our ends of its two pipes."""

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        # The child must import this package even when we found it through the working directory.
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        )
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_CODE, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self.requests = Connection(to_child_w, readable=False)
        self.replies = Connection(from_child_r, writable=False)
        self.ready = False

    def call(self, pred: str, gold: str, timeout_s: float) -> bool:
        """The worker's verdict. TimeoutError when it overruns; EOFError or OSError when it is dead."""
        if not self.ready:
            if not self.replies.poll(_STARTUP_TIMEOUT_S):
                raise TimeoutError(f"math-verify worker did not start within {_STARTUP_TIMEOUT_S}s")
            try:
                ready = self.replies.recv()
            except EOFError:
                _log.warning("a math-verify worker exited while starting (exit code %s)", self.proc.poll())
                raise
            if ready != _READY:
                raise RuntimeError(f"math-verify worker said {ready!r} instead of {_READY!r}")
            self.ready = True
        self.requests.send((pred, gold, timeout_s))
        if not self.replies.poll(timeout_s):
            raise TimeoutError(f"math-verify took longer than {timeout_s}s")
        return bool(self.replies.recv())

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        self.requests.close()  # a live, idle worker sees EOF and returns
        self.replies.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class VerifyPool:
    """`size` workers behind a queue of slots; a thread takes a slot, uses its worker, gives it back.
    An empty slot (None) starts a worker when next taken."""

    def __init__(self, size: int) -> None:
        self._slots: queue.Queue[_Worker | None] = queue.Queue()
        self._closed = False
        for _ in range(size):
            # Start them all now, so they import in parallel rather than one per first call.
            self._slots.put(self._start())

    @staticmethod
    def _start() -> _Worker | None:
        try:
            return _Worker()
        except Exception:
            _log.warning("cannot start a math-verify worker process", exc_info=True)
            return None

    def verify(self, pred: str, gold: str, timeout_s: float) -> bool:
        worker = self._slots.get()
        try:
            for _ in range(2):  # a worker found dead (killed while idle, say) is replaced by a fresh one, once
                if worker is None:
                    worker = self._start()
                if worker is None:
                    return _compare_without_process(pred, gold, timeout_s)
                healthy = False
                try:
                    result = worker.call(pred, gold, timeout_s)
                    healthy = True
                    return result
                except TimeoutError as e:  # before OSError: TimeoutError is one
                    _log.debug("%s; killing the worker", e)
                    return False  # a timeout counts as "not equal"
                except (EOFError, OSError) as e:
                    _log.debug("math-verify worker died (%r); retrying with a fresh one", e)
                except Exception:
                    _log.warning("math-verify worker failed; graded as not equal", exc_info=True)
                    return False
                finally:
                    # A worker that did not answer may still hold our request: it can never be reused.
                    if not healthy or self._closed:
                        worker.stop(kill=not healthy)
                        worker = None
            return False
        finally:
            self._slots.put(worker)

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                worker = self._slots.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.stop()


def _compare_without_process(pred: str, gold: str, timeout_s: float) -> bool:
    """Where no worker can start: math-verify in-process, whose SIGALRM limits need the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    return compare(pred, gold, timeout_s)


_pool: VerifyPool | None = None
_pool_lock = threading.Lock()


def verify(pred: str, gold: str, timeout_s: float) -> bool:
    """math-verify's verdict on (normalised) `pred` against `gold`; False on timeout or any failure."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = VerifyPool(default_size())
        pool = _pool
    return pool.verify(pred, gold, timeout_s)


def shutdown() -> None:
    """Stop the workers (a later `verify` starts new ones). Workers busy now stop when they finish."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()


atexit.register(shutdown)
