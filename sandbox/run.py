"""One run on one worker, seen from the server: descriptors out, output and exit status back.

The server creates the run's stdout/stderr pipes and a socket, hands their child ends to the worker
(pool.Zygote.spawn: to the child it prepared ahead, else through its zygote) and streams the request
(code, stdin, files) straight to that child (child.py), so the zygote never holds run data. Output is captured here up to a cap per stream (the rest
is drained and counted, then a marker says how much was dropped). The zygote's exit report is the
word on how a run ended when the child could not say it itself (timeout, OOM kill, `os._exit`). A child
that finishes normally first kills and reaps every other process of its PID namespace, then reports,
so the answer does not wait for the kernel to tear the namespaces down; the worker takes its next run
only after the zygote has reaped this one. Cancelling `execute` (client gone) kills the run.
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
from typing import TYPE_CHECKING, Any

from sandbox.child import SETUP_FAILED
from sandbox.settings import Settings

if TYPE_CHECKING:
    from sandbox.pool import Zygote

GRACE_S = 10.0  # beyond the run's own timeout, how long the zygote may take to report
F_SETPIPE_SZ = 1031


class ZygoteDied(Exception):
    """The worker's zygote exited (or was stopped) while a run depended on it."""


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


@dataclass
class Outcome:
    status: str  # "Finished" | "TimeLimitExceeded" | "Error" (the sandbox failed, not the program)
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    files: dict[str, str] = field(default_factory=dict)
    message: str = ""


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


def limits_for(settings: Settings, timeout_s: float, memory_mb: int, map_self: bool) -> dict[str, Any]:
    return {
        "cpu_s": timeout_s + 1,
        "memory_mb": memory_mb,
        # Single-uid fallback: the zygote shares the run's uid and counts against RLIMIT_NPROC.
        "nproc": settings.max_processes + (2 if map_self else 0),
        "nofile": settings.max_open_files,
        "fsize_mb": settings.max_file_size_mb,
        "fetch_bytes": settings.max_fetch_bytes,
        "request_bytes": settings.max_request_bytes + (1 << 20),
    }


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


async def execute(worker: Zygote, job: Job, settings: Settings, release: Callable[[Zygote], None]) -> Outcome:
    """Run `job` on `worker`; `release(worker)` is called once the zygote has reaped the run."""
    loop = asyncio.get_running_loop()
    run_id = uuid.uuid4().hex
    msg = {"op": "run", "id": run_id, "lang": job.language, "timeout": job.timeout_s,
           "limits": limits_for(settings, job.timeout_s, job.memory_mb, worker.map_self)}
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
    payload = json.dumps({"code": job.code, "stdin": job.stdin, "files": job.files,
                          "fetch_files": job.fetch_files, "args": job.args}).encode()
    sender = _send_now(loop, sock, payload)
    report = OutputCapture(os.dup(sock.fileno()), settings.max_report_bytes)
    try:
        # EOF on the report socket comes either with the child's own report (it killed and reaped
        # everything else first) or when it died (timeout, OOM, os._exit): then the zygote's word counts.
        await asyncio.wait_for(asyncio.shield(report.done), job.timeout_s + GRACE_S)
        child = _checked_report(report.data)
        if isinstance(child.get("code"), int):
            await _streams_closed(out, err)
            return Outcome("Finished", child.get("time"), child["code"], out.take(), err.take(),
                           files=child.get("files") or {})
        final = await asyncio.wait_for(asyncio.shield(exited), GRACE_S)
        await _streams_closed(out, err)
        return _outcome(final, child, out.take(), err.take())
    except asyncio.CancelledError:
        worker.control({"op": "kill", "id": run_id})  # the client left: end the run now
        raise
    except asyncio.TimeoutError:
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
    """Both outputs read to EOF. A child that finished closed them before reporting, so the rest is
    already in the pipes; waiting (bounded) is only for a report forged while the program runs on."""
    for capture in (out, err):
        capture.drain()
        if not capture.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(capture.done), GRACE_S)
            except asyncio.TimeoutError:
                return


def _outcome(final: dict[str, Any], child: dict[str, Any], stdout: str, stderr: str) -> Outcome:
    elapsed = final.get("elapsed")
    if final.get("error") or child.get("error"):
        return Outcome("Error", elapsed, stdout=stdout, stderr=stderr,
                       message=final.get("error") or child["error"])
    if final.get("timed_out"):
        return Outcome("TimeLimitExceeded", elapsed, None, stdout, stderr, message="run_timeout exceeded")
    if final["code"] == SETUP_FAILED:
        return Outcome("Error", elapsed, stdout=stdout, stderr=stderr,
                       message="the sandbox could not prepare the run (details in the server log)")
    return Outcome("Finished", elapsed, final["code"], stdout, stderr)


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


def _checked_report(data: bytearray) -> dict[str, Any]:
    """The child's report. Its socket is reachable by the program (fd 3), so the report is checked
    like any input; garbage only spoils this run's own answer, and then the zygote's word decides."""
    try:
        report = json.loads(bytes(data) or b"{}")
    except ValueError:
        return {}
    if not isinstance(report, dict):
        return {}
    check_files_and_time(report)
    if not isinstance(report.get("error", ""), str):
        report["error"] = "the run's report was malformed"
    return report


def check_files_and_time(report: dict[str, Any]) -> None:
    """Reset a child's `files` (a dict of strings) and `time` (a number) where they are not that: reports
    and session replies come over a socket the program can write to."""
    files = report.get("files") or {}
    if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())):
        report["files"] = {}
    if not isinstance(report.get("time"), (int, float)):
        report["time"] = None
