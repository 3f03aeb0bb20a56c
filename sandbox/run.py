"""One run on one worker, seen from the server: descriptors out, output and the supervisor's report back.

The server creates the run's stdout/stderr pipes and a socket, hands their child ends to the worker
(worker.Zygote.spawn: to the supervisor it prepared ahead, else through its zygote) and streams the
request (code, stdin, files) to that supervisor (supervisor.py), so the zygote never holds run data.
Output is captured here up to a cap per stream (the rest is drained and counted, then a marker says how
much was dropped). The report comes from the supervisor, which the program cannot reach, and only once
every process of the run is dead; so the output is complete when it arrives, and its status, return code,
time and files are the supervisor's own observations. No report (the supervisor died, or the zygote's
backstop killed it) is a failure of the sandbox. The worker takes its next run only after the zygote has
reaped this one. Cancelling `execute` (client gone) kills the run.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from sandbox.program import SETUP_FAILED
from sandbox.settings import Settings
from sandbox.worker import Zygote, ZygoteDied, limits_for

GRACE_S = 10.0  # beyond the run's own time, how long its setup, teardown and report may take
F_SETPIPE_SZ = 1031


@dataclass
class Job:
    code: str
    language: str  # "python" | "bash"
    timeout_s: float
    memory_mb: int
    stdin: str | None = None
    files: dict[str, str | None] = field(default_factory=dict)  # relative path -> base64
    fetch_files: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)

    @cached_property
    def payload(self) -> bytes:
        """The request as the run's supervisor receives it; the server measures it against the run's
        memory budget first, so it is encoded once."""
        return json.dumps({"code": self.code, "stdin": self.stdin, "files": self.files,
                           "fetch_files": self.fetch_files, "args": self.args}).encode()


@dataclass
class Outcome:
    status: str  # "Finished" | "TimeLimitExceeded" | "Error" (the sandbox failed, not the program)
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    files: dict[str, str] = field(default_factory=dict)
    message: str = ""
    refused: str = ""  # the request could not be set up (its files do not fit): server.py answers 413
    # the supervisor failed to set itself up before the program started (nothing of the run happened), so a
    # fresh one may take the same run
    setup_failed: bool = False


class OutputCapture:
    """Reads a non-blocking pipe (or socket) from the event loop, keeping the first `cap` bytes.
    Plain reader callbacks rather than tasks: a run costs the event loop a handful of callbacks."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.data = bytearray()
        self.total = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        os.set_blocking(fd, False)
        try:  # a larger pipe: fewer wake-ups for chatty programs
            fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass  # not a pipe (the report socket)
        asyncio.get_running_loop().add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:  # a reset socket: the child died with request bytes unread
            chunk = b""
        self._keep(chunk)

    def _keep(self, chunk: bytes) -> bool:
        """Count `chunk`, keep what fits under the cap; an empty chunk (EOF) closes. False at EOF."""
        if not chunk:
            self.close()
            return False
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        return True

    def drain(self) -> None:
        """Read what is already in the pipe (a session call's output before its reply)."""
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return
            if not self._keep(chunk):
                return

    def take(self) -> str:
        """The captured text (with a truncation marker), then start over for the next call."""
        text = self.data.decode("utf-8", errors="replace")
        if self.total > len(self.data):
            text += f"\n[... output truncated: {self.total} bytes written, the first {len(self.data)} kept ...]\n"
        self.data, self.total = bytearray(), 0
        return text

    def close(self) -> None:
        """Stop reading and close the descriptor, once. Its own flag, not `done`: a waiter that was
        cancelled can cancel `done`, and the reader of a socket at EOF would then fire forever."""
        if self.fd >= 0:
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.fd = -1
        if not self.done.done():
            self.done.set_result(None)


def open_channels(settings: Settings, host_uid: int | None,
                  ) -> tuple[socket.socket, list[int], OutputCapture, OutputCapture]:
    """Server socket end, the child's descriptors [socket, stdout, stderr], and the two captures.
    The pipes are handed to the run's host uid so that it can reopen them (`echo x > /dev/stderr`).
    On an error (e.g. out of descriptors) whatever was opened is closed again."""
    opened: list[Any] = []
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        opened += [ours, theirs]
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        opened += [out_r, out_w]
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        opened += [err_r, err_w]
        if host_uid is not None:
            for fd in (out_w, err_w):
                os.fchown(fd, host_uid, host_uid)
        ours.setblocking(False)
        out = OutputCapture(out_r, settings.max_output_bytes)
        opened.remove(out_r)
        opened.append(out)
        err = OutputCapture(err_r, settings.max_output_bytes)
    except BaseException:
        for thing in opened:
            if isinstance(thing, int):
                os.close(thing)
            else:
                thing.close()
        raise
    return ours, [theirs.detach(), out_w, err_w], out, err


def backstop_s(timeout_s: float) -> float:
    """How long the zygote lets a run's supervisor live: its setup and its run may each take the run's
    timeout, then it kills everything, reads files and reports."""
    return 2 * timeout_s + GRACE_S


async def execute(worker: Zygote, job: Job, settings: Settings, release: Callable[[Zygote], None]) -> Outcome:
    """Run `job` on `worker`; `release(worker)` is called once the zygote has reaped the run."""
    loop = asyncio.get_running_loop()
    run_id = uuid.uuid4().hex
    msg = {"op": "run", "id": run_id, "lang": job.language, "timeout": job.timeout_s,
           "backstop": backstop_s(job.timeout_s),
           "limits": limits_for(settings, job.timeout_s, job.memory_mb, worker.map_self, worker.memory_cgroup)}
    try:
        sock, child_fds, out, err = open_channels(settings, worker.host_uid(worker.uid))
    except OSError as e:  # e.g. out of descriptors: the worker goes back to the pool unused
        release(worker)
        return Outcome("Error", message=f"could not start the run: {e}")
    try:
        worker.set_memory_limit(job.memory_mb)
        exited = worker.spawn(msg, child_fds)
    except (OSError, ZygoteDied) as e:
        for closing in (sock.close, out.close, err.close):
            closing()
        release(worker)
        return Outcome("Error", message=f"could not start the run: {e}")
    finally:
        for fd in child_fds:
            os.close(fd)
    exited.add_done_callback(lambda f: (f.cancelled() or f.exception(), release(worker)))
    sender = _send_now(loop, sock, job.payload)
    report = OutputCapture(os.dup(sock.fileno()), settings.max_report_bytes)
    try:
        # EOF on the report socket: the supervisor's report is complete, or it died without one.
        await asyncio.wait_for(asyncio.shield(report.done), backstop_s(job.timeout_s) + GRACE_S)
        result = _checked_report(report.data)
        if result is None:
            final = await asyncio.wait_for(asyncio.shield(exited), GRACE_S)
            await _streams_closed(out, err)
            why = "killed at its backstop deadline" if final.get("timed_out") else (
                final.get("error") or f"exit status {final.get('code')}")
            stdout, stderr = out.take(), err.take()
            return Outcome("Error", final.get("elapsed"), stdout=stdout, stderr=stderr,
                           message=f"the run's supervisor ended without a report ({why})",
                           setup_failed=final.get("code") == SETUP_FAILED and not stdout and not stderr)
        await _streams_closed(out, err)
        return _outcome(result, out.take(), err.take(), settings)
    except asyncio.CancelledError:
        worker.control({"op": "kill", "id": run_id})  # the client left: end the run now
        raise
    except TimeoutError:
        await worker.stop()  # a zygote that cannot report is broken: the pool replaces it
        return Outcome("Error", message="the sandbox worker stopped responding; it was restarted")
    except ZygoteDied as e:
        return Outcome("Error", message=str(e))
    finally:
        if sender is not None:
            sender.cancel()
        for closing in (report.close, out.close, err.close, sock.close):
            closing()


async def _streams_closed(out: OutputCapture, err: OutputCapture) -> None:
    """Both outputs read to EOF. Every writer is dead when the supervisor reports, so the rest is already
    in the pipes; the wait is bounded all the same."""
    for capture in (out, err):
        capture.drain()
        if not capture.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(capture.done), GRACE_S)
            except TimeoutError:
                return


def _outcome(report: dict[str, Any], stdout: str, stderr: str, settings: Settings) -> Outcome:
    status, elapsed = report["status"], report.get("time")
    if status == "refused":
        return Outcome("Error", refused=report["error"])
    if status == "error":
        return Outcome("Error", elapsed, stdout=stdout, stderr=stderr, message=report["error"])
    skipped = report.get("fetch_skipped") or {}
    left_out = ", ".join(f"{name} ({size} bytes)" for name, size in skipped.items())
    message = f"fetch_files over the {settings.max_fetch_bytes}-byte budget left out: {left_out}" if skipped else ""
    refused = report.get("fetch_refused") or {}
    if refused:  # links the program left that lead out of its /tmp: named, never followed
        why = ", ".join(f"{name} ({reason})" for name, reason in refused.items())
        message = "; ".join(filter(None, [message, f"fetch_files refused: {why}"]))
    if status == "timeout":
        return Outcome("TimeLimitExceeded", elapsed, None, stdout, stderr, report["files"], message)
    return Outcome("Finished", elapsed, report["code"], stdout, stderr, report["files"], message)

def _send_now(loop: asyncio.AbstractEventLoop, sock: socket.socket, payload: bytes) -> asyncio.Task[None] | None:
    """Send the request; a task finishes the job only when it does not fit the socket buffer."""
    try:
        sent = sock.send(payload)
    except BlockingIOError:
        sent = 0
    except OSError:
        return None  # the child is already gone; its exit report says why
    if sent < len(payload):
        return asyncio.create_task(_send(loop, sock, payload[sent:]))
    sock.shutdown(socket.SHUT_WR)
    return None


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, payload: bytes) -> None:
    try:
        await loop.sock_sendall(sock, payload)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the child is already gone (killed, or setup failed); its exit report says why


def _checked_report(data: bytearray) -> dict[str, Any] | None:
    """The supervisor's report, or None when there is none (it died before writing one)."""
    try:
        report = json.loads(bytes(data) or b"null")
    except ValueError:
        return None
    if not isinstance(report, dict) or report.get("status") not in ("finished", "timeout", "error", "refused"):
        return None
    return report


def check_files_and_time(report: dict[str, Any]) -> None:
    """Reset a session reply's `files` (a dict of strings) and `time` (a number) where they are not that:
    session replies come from the session's own process, which runs the session's code."""
    files = report.get("files") or {}
    if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        report["files"] = {}
    if not isinstance(report.get("time"), (int, float)):
        report["time"] = None
