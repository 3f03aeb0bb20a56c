"""Worker processes for the slow part of math grading: sympy through math-verify, with a hard timeout.

math.py settles most answers in-process (equal after normalisation, or two plain numbers) and sends only
the rest here. Why processes: math-verify's own timeouts use SIGALRM, which works only in the main thread
(the trainer grades from threads and from inside asyncio loops), and no signal interrupts a long C-level
computation such as the exact integer 10^{10^{10}}. So each comparison runs in a persistent worker
(agentrl/worker_process.py); the caller waits at most `timeout_s`, and a worker that overruns is killed
and a fresh one takes its slot. Workers start on first use and are reused; `shutdown()` (also run at exit)
stops them.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import threading

from agentrl.worker_process import WorkerProcess

_log = logging.getLogger(__name__)

# A fresh worker imports sympy and math-verify (about a second; longer while several start on a busy
# machine). That wait is not the comparison's fault, so it has its own, generous, limit.
_STARTUP_TIMEOUT_S = 60.0
# Exact arithmetic on a pathological answer can eat memory faster than the timeout ends it.
_WORKER_MEMORY_BYTES = 4 << 30


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


def handle(request: tuple[str, str, float]) -> bool:
    """A worker's answer to one `(pred, gold, timeout_s)` request."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # its timeout warnings are expected
    return compare(*request)


# --- in the grading process ---------------------------------------------------------------------------


class _Worker(WorkerProcess):
    def __init__(self) -> None:
        super().__init__("agentrl.rewards.verify_pool:handle", preload=("math_verify",),
                         memory_bytes=_WORKER_MEMORY_BYTES)

    def call(self, pred: str, gold: str, timeout_s: float) -> bool:
        """The worker's verdict. TimeoutError when it overruns; EOFError or OSError when it is dead."""
        try:
            self.wait_ready(_STARTUP_TIMEOUT_S, "math-verify")
        except EOFError:
            _log.warning("a math-verify worker exited while starting (exit code %s)", self.proc.poll())
            raise
        self.send((pred, gold, timeout_s))
        if not self.replies.poll(timeout_s):
            raise TimeoutError(f"math-verify took longer than {timeout_s}s")
        return bool(self.receive())


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
