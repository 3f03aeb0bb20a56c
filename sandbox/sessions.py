"""Stateful Python sessions: one long-lived confined child per session, globals kept across calls.

A session is a supervisor (supervisor.py) with one program process (program.py, `session_loop`), forked
by a dedicated zygote (worker.Zygote with `sessions=True`), confined like a run and with its own uid, so
sessions can neither see nor signal nor reach each other. Calls go over the session's socket as length-prefixed
frames; stdout/stderr are per call. A call over its `run_timeout` is interrupted (SIGINT ->
KeyboardInterrupt, the session survives); one that ignores the interrupt for `INTERRUPT_GRACE_S` takes its
session down. Sessions unused for their idle timeout are closed; at most `max_sessions` live at once.
Each session's memory budget is the limit of a memory cgroup of its own (cgroups.py), which its process
joins before its first call; the live sessions' budgets together stay within `sessions_memory_mb`, so
no session's use can get another's processes OOM-killed. server.py maps `SessionError` to its HTTP status.

A session belongs to its creator: clients reach it only through its `token` (128 random bits, compared
in constant time), which only the creator receives; an unknown token, a closed session's and a mistyped
one all get the same 404. The zygote knows the session by a separate internal `id`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from sandbox.cgroups import CgroupSet
from sandbox.models import SessionRunRequest
from sandbox.run import Outcome, OutputCapture, check_files_and_time, open_channels
from sandbox.settings import MB, Settings
from sandbox.wire import FRAME_HEADER, encode_frame
from sandbox.worker import Zygote, ZygoteDied, limits_for

INTERRUPT_GRACE_S = 2.0
# Each session's supervisor, and what its program writes before it joins its own group, are counted in the
# session worker's `zygote` group: its cap has this much per session beyond the sessions' budgets.
SESSION_OVERHEAD_MB = 8


log = logging.getLogger(__name__)

class SessionError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Session:
    id: str  # the zygote's name for it; never given to clients
    token: str  # the creator's handle: the `session_id` of the HTTP API
    memory_mb: int
    idle_timeout: float
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    out: OutputCapture
    err: OutputCapture
    exited: asyncio.Future[dict[str, Any]]
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def close_channels(self) -> None:
        self.writer.close()
        self.out.close()
        self.err.close()


class SessionManager:
    def __init__(self, settings: Settings, cgroups: CgroupSet | None, uid_base: int) -> None:
        self.settings = settings
        self.uid_base = uid_base
        self.zygote = self._new_zygote(cgroups)
        self.sessions: dict[str, Session] = {}
        self._starting = 0  # sessions being created: they hold a slot across the awaits of create()
        self._budgets: dict[str, int] = {}  # session id -> its memory budget, from admission until it has ended
        self._group_of: dict[str, tuple[str, str]] = {}  # session id -> (worker cgroup, leaf) of its memory group
        self._retired: set[tuple[str, str]] = set()  # groups of ended sessions still to remove
        self._oom_kills = 0  # OOM kills inside the groups of sessions that have ended
        self._counter = 0
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self._restart_lock = asyncio.Lock()
        self._restarts: set[asyncio.Task[None]] = set()

    def _new_zygote(self, cgroups: CgroupSet | None) -> Zygote:
        s = self.settings
        zygote = Zygote("sessions", s.session_uid, s, cgroups, self.uid_base, sessions=True,
                        cgroup_memory_mb=s.sessions_memory_mb + s.max_sessions * SESSION_OVERHEAD_MB,
                        cgroup_pids=s.max_sessions * s.max_processes)
        zygote.on_death = self._on_death
        return zygote

    def _on_death(self, dead: Zygote) -> None:
        """Replace the sessions' zygote as soon as it dies (its launcher reaped, no zombie left), so the
        next session does not pay its start-up; `create` also restarts it if this has not finished."""
        task = asyncio.create_task(self._ensure_zygote())
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _ensure_zygote(self) -> None:
        async with self._restart_lock:
            if self.zygote.alive:
                return
            await self.zygote.stop()
            self.zygote = self._new_zygote(self.zygote.cgroups)
            try:
                await self.zygote.start(self.settings.preload)
            except Exception as e:  # noqa: BLE001 - the next create tries again and reports the failure
                log.error("restarting the sessions' zygote failed: %s", e)

    async def start(self) -> None:
        await self.zygote.start(self.settings.preload)
        self._reaper = asyncio.create_task(self._reap_idle())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._restarts):
            task.cancel()
        for sid in list(self.sessions):
            await self.close(sid)
        await self.zygote.stop()

    async def create(self, memory_mb: int, idle_timeout: float | None) -> Session:
        if not self.zygote.alive:
            await self._ensure_zygote()
            if not self.zygote.alive:
                raise SessionError(503, "the sessions' sandbox worker could not be restarted")
        if len(self.sessions) + self._starting >= self.settings.max_sessions:
            raise SessionError(429, f"{self.settings.max_sessions} sessions are open; close one first")
        cap, held = self.settings.sessions_memory_mb, sum(self._budgets.values())
        if memory_mb > cap:
            raise SessionError(422, f"memory_limit_MB is {memory_mb}; all sessions together may use {cap} MB "
                                    "(--sessions-memory-mb)")
        if held + memory_mb > cap:
            raise SessionError(429, f"the open sessions hold {held} MB of the {cap} MB all sessions may use "
                                    f"(--sessions-memory-mb); this one asks for {memory_mb} MB: close one, or "
                                    "ask for less memory_limit_MB")
        sid = uuid.uuid4().hex
        self._budgets[sid] = memory_mb  # held until the session has ended (`_ended`), taken before any await
        self._starting += 1
        try:
            return await self._create(sid, memory_mb, idle_timeout)
        finally:
            self._starting -= 1

    async def _create(self, sid: str, memory_mb: int, idle_timeout: float | None) -> Session:
        n = self._counter
        self._counter += 1
        uid = self.settings.session_uid + n % 40000  # own uid: own RLIMIT_NPROC, no signals
        try:
            sock, child_fds, out, err = open_channels(self.settings, self.zygote.host_uid(uid))
        except OSError as e:
            self._ended(sid)
            raise SessionError(503, f"could not start a session: {e}") from None
        group = self._memory_group(sid, n, memory_mb)  # joined by the session's process as it prepares
        child_fds += group
        limits = limits_for(self.settings, self.settings.session_cpu_s, memory_mb, self.zygote.map_self, bool(group))
        try:
            exited = self.zygote.spawn({"op": "session", "id": sid, "limits": limits}, child_fds, uid=uid)
        except (ZygoteDied, OSError) as e:  # OSError: the zygote died and we have not yet seen it
            for channel in (sock, out, err):
                channel.close()
            self._ended(sid)
            raise SessionError(503, f"could not start a session: {e}") from None
        finally:
            for fd in child_fds:
                os.close(fd)
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:  # cancelled (the server stops) or failed: the session must not outlive this
            exited.add_done_callback(lambda f: self._ended(sid))
            self.zygote.control({"op": "kill", "id": sid})
            for channel in (sock, out, err):
                channel.close()
            raise
        session = Session(sid, secrets.token_urlsafe(16), memory_mb, self.settings.clamp_idle(idle_timeout),
                          reader, writer, out, err, exited)
        self.sessions[sid] = session
        exited.add_done_callback(lambda f: self._ended(sid))
        return session

    def _memory_group(self, sid: str, n: int, memory_mb: int) -> list[int]:
        """The session's own memory cgroup (`session.<n>`: named by a count, not by the session's id, which
        its code can read there), its budget as the limit: [a descriptor the session's process joins it
        with], or [] where there are no cgroups (RLIMIT_AS then bounds each of its processes)."""
        cgroups = self.zygote.cgroups
        if cgroups is None:
            return []
        try:
            fd = cgroups.open_session(self.zygote.cgroup, f"session.{n}", memory_mb * MB)
        except OSError as e:
            log.warning("no memory cgroup for a session (%s): its processes get RLIMIT_AS instead", e)
            return []
        self._group_of[sid] = (self.zygote.cgroup, f"session.{n}")
        return [fd]

    def _ended(self, sid: str) -> None:
        """The session's processes are gone (or never started): its channels, budget and group go too."""
        session = self.sessions.pop(sid, None)
        if session is not None and not session.lock.locked():
            session.close_channels()
        self._budgets.pop(sid, None)
        self._retire_group(sid)

    def _retire_group(self, sid: str) -> None:
        """Remove the memory group of a session that has ended, and those of earlier ones whose removal
        failed (a group still holding a process that is exiting: tried again at the next session's end)."""
        group = self._group_of.pop(sid, None)
        cgroups = self.zygote.cgroups
        if group is not None and cgroups is not None:
            worker, leaf = group
            self._oom_kills += cgroups.oom_kills(worker, (leaf,))
            self._retired.add(group)
        for worker, leaf in list(self._retired):
            if cgroups is None or cgroups.remove_session(worker, leaf):
                self._retired.discard((worker, leaf))

    def get(self, token: str) -> Session:
        """The live session whose token is `token`. Every live token is compared, in constant time, so
        neither the answer nor its timing tells how close a guess came."""
        given = token.encode("utf-8", errors="surrogatepass")
        found = None
        for session in list(self.sessions.values()):
            if hmac.compare_digest(session.token.encode(), given):
                found = session
        if found is None:
            raise SessionError(404, f"no session {token[:64]!r} (never created, closed, expired or crashed)")
        return found

    async def call(self, token: str, frame: bytes, run_timeout: float) -> Outcome:
        """Run one call (`frame`: see `session_frame`) in the session `token` names."""
        session = self.get(token)
        sid = session.id
        async with session.lock:  # calls of one session run one after the other
            if self.sessions.get(sid) is not session:  # closed while this call waited for the one before
                raise SessionError(404, f"session {sid!r} was closed while this call waited for the one before")
            timeout = self.settings.clamp_timeout(run_timeout)
            try:
                session.writer.write(frame)
                await session.writer.drain()
                reply = await self._reply(session, timeout)
            except (ConnectionError, RuntimeError, asyncio.IncompleteReadError):  # RuntimeError: a closed transport
                reply = None
            except asyncio.CancelledError:  # the client left mid-call: its reply would desynchronise
                closing = asyncio.ensure_future(self.close(sid))  # the next call, so end the session
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
                raise
            finally:
                session.last_used = time.monotonic()
            if reply is None:  # the session process is gone (OOM kill, os._exit, CPU budget), or it sent garbage
                if session.reader.at_eof():  # gone: its supervisor reports how it ended, then exits by itself
                    await _exit_report(session)
                await self.close(sid)
                final = await _exit_report(session)
                session.out.drain()
                session.err.drain()
                outcome = Outcome("Finished", None, final.get("code"), session.out.take(), session.err.take(),
                                  message="the session ended; its state is gone")
                session.close_channels()
                return outcome
            session.out.drain()
            session.err.drain()
            stdout, stderr = session.out.take(), session.err.take()
            if reply.get("refused"):  # this call's files do not fit what the session's /tmp has left
                return Outcome("Error", refused=reply["refused"])
            if reply.get("error"):
                return Outcome("Error", reply.get("time"), stdout=stdout, stderr=stderr, message=reply["error"])
            if reply.get("timed_out"):
                return Outcome("TimeLimitExceeded", timeout, None, stdout, stderr, message=reply["timed_out"])
            return Outcome("Finished", reply.get("time"), reply["code"], stdout, stderr,
                           files=reply.get("files") or {})

    async def _reply(self, session: Session, timeout: float) -> dict[str, Any] | None:
        read = asyncio.ensure_future(_read_frame(session.reader, self.settings.max_report_bytes))
        done, _ = await asyncio.wait([read], timeout=timeout)
        if done:
            return read.result()
        self.zygote.control({"op": "signal", "id": session.id, "signal": int(signal.SIGINT)})
        done, _ = await asyncio.wait([read], timeout=INTERRUPT_GRACE_S)
        if done and read.result() is not None:
            reply = read.result()
            reply["timed_out"] = "run_timeout exceeded; the call was interrupted, the session kept its state"
            return reply
        read.cancel()
        await self.close(session.id)
        return {"timed_out": "run_timeout exceeded and the call ignored the interrupt; the session was closed"}

    async def close(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is None:
            return
        self.zygote.control({"op": "kill", "id": sid})
        await _exit_report(session)
        session.out.drain()
        session.err.drain()
        session.close_channels()

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.settings.session_idle_s / 4))
            now = time.monotonic()
            for sid, session in list(self.sessions.items()):
                if not session.lock.locked() and now - session.last_used > session.idle_timeout:
                    await self.close(sid)

    def status(self) -> dict[str, int]:
        """Counts for /health: live sessions, the cap, and the OOM kills inside sessions' own memory groups."""
        cgroups, live = self.zygote.cgroups, list(self._group_of.values())
        oom = self._oom_kills + (sum(cgroups.oom_kills(w, (leaf,)) for w, leaf in live) if cgroups else 0)
        return {"sessions": len(self.sessions), "max_sessions": self.settings.max_sessions, "session_oom_kills": oom}


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> dict[str, Any] | None:
    """The session's reply, or None when the session is gone or sent something that is not a reply
    (the socket is reachable from the session's own code: its frames are checked like any input)."""
    try:
        (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
        if length > limit:
            return None
        reply = json.loads(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ValueError):
        return None
    if not isinstance(reply, dict) or not isinstance(reply.get("code"), int):
        return None
    check_files_and_time(reply)
    if any(not isinstance(reply.get(key) or "", str) for key in ("error", "refused", "timed_out")):
        reply["error"], reply["refused"], reply["timed_out"] = "the session's reply was malformed", None, None
    return reply


def session_frame(req: SessionRunRequest) -> bytes:
    """One call as the session's process receives it (server.py measures it against the session's memory)."""
    return encode_frame({"code": req.code, "stdin": req.stdin, "files": req.files, "fetch_files": req.fetch_files})


async def _exit_report(session: Session) -> dict[str, Any]:
    try:
        return await asyncio.wait_for(asyncio.shield(session.exited), INTERRUPT_GRACE_S * 2)
    except (TimeoutError, ZygoteDied):
        return {}
