"""The server's handle on one zygote (zygote.py): start it, talk to it, hand it runs and sessions.

`Zygote` owns one zygote process tree: it spawns the launcher with a scrubbed environment (its stderr a
pipe copied into the server's log, so no process of the tree holds a host file), puts it in its cgroup,
sets its OOM floor (`_set_oom_floor`), writes its uid/gid maps (when the server is root), hands it the
descriptor that lets a run's program join the run's memory cgroup, and then exchanges control messages
with it on a SEQPACKET socket read from the event loop. A run worker's zygote also sends the channel of the supervisor it prepared
ahead (supervisor.py), so a run is handed to it directly (the zygote is told afterwards and starts the
backstop deadline): one process hop less on every request. pool.py keeps a pool of run workers;
sessions.py uses a dedicated zygote of its own; run.py drives one run.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from sandbox import libc
from sandbox.cgroups import CgroupSet
from sandbox.program import run_environment
from sandbox.rootfs import RootSpec
from sandbox.settings import MB, Settings
from sandbox.wire import recv_msg, send_msg

log = logging.getLogger("sandbox.worker")

# The zygote's whole environment, which is also every run's: runs can read it back from
# /proc/self/environ, and it holds nothing of the server's.
ZYGOTE_ENV = run_environment(sys.prefix)
BOOT = "from sandbox.zygote import main; main()"
STARTUP_TIMEOUT_S = 180.0
ZYGOTE_OVERHEAD_MB = 384  # the zygote's and the forker's own resident memory, counted in their cgroup next to the run's
_incarnations = itertools.count(1)
CAP_SYS_RESOURCE = 24


class ZygoteDied(Exception):
    """The worker's zygote exited (or was stopped) while a run depended on it."""


def limits_for(settings: Settings, timeout_s: float, memory_mb: int, map_self: bool,
               cgroup_memory: bool) -> dict[str, Any]:
    return {
        "cpu_s": timeout_s + 1,
        "memory_mb": memory_mb,
        "cgroup_memory": cgroup_memory,  # True: the run's (session's) cgroup counts memory; False: RLIMIT_AS does
        # The next run's prepared process shares the uid (+1); in the single-uid fallback the launcher, the
        # zygote, the forker and the two supervisors do too.
        "nproc": settings.max_processes + (6 if map_self else 1),
        "nofile": settings.max_open_files,
        "fsize_mb": settings.max_file_size_mb,
        "fetch_bytes": settings.max_fetch_bytes,
        "request_bytes": settings.max_request_bytes + (1 << 20),
    }


class Zygote:
    def __init__(self, name: str, inside_uid: int, settings: Settings, cgroups: CgroupSet | None,
                 uid_base: int, sessions: bool = False, cgroup_memory_mb: int | None = None,
                 cgroup_pids: int | None = None) -> None:
        self.name = name
        # Each zygote its own cgroup: a replacement has the name of the one it replaces, and removing the
        # dead one's group (which may happen again after the replacement started) must not touch its own.
        self.cgroup = f"{name}.{next(_incarnations)}"
        self.uid_base = uid_base  # host uid behind uid 0 of the zygote's user namespace
        self.cgroup_memory_mb = cgroup_memory_mb or settings.max_memory_mb
        self.cgroup_pids = (cgroup_pids or settings.max_processes) + 16
        self.sessions = sessions  # the sessions' zygote: children on demand, no prepared spare
        self.settings = settings
        self.cgroups = cgroups
        self.map_self = os.geteuid() != 0 or settings.single_uid
        self.uid = self.gid = 0 if self.map_self else inside_uid
        self.proc: subprocess.Popen[bytes] | None = None
        self.ctl: socket.socket | None = None
        self.alive = False
        self._inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._exits: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._memory_limit = 0
        self.zygote_pid: int | None = None  # host pid of the zygote (the launcher's only child)
        self.on_death: Callable[[Zygote], None] | None = None  # the pool replaces a worker that died
        self._spare: tuple[int, socket.socket] | None = None  # a prepared child's channel (runs only)

    async def start(self, preload: tuple[str, ...], warmup: tuple[str, ...] = ()) -> None:
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # Spawned from the event loop's (main) thread: PR_SET_PDEATHSIG fires when the spawning
        # *thread* exits, so a worker thread would kill the zygote when it finished.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BOOT, str(child.fileno()), str(os.getpid())],
            pass_fds=[child.fileno()], env=ZYGOTE_ENV, cwd=package_parent,
            # stderr a pipe, never the server's own (often its log file): every supervisor inherits it, and
            # a descriptor of a host file is one /proc/<pid>/fd/N path away from being reopened.
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        threading.Thread(target=_forward_stderr, args=(self.proc.stderr, self.name), daemon=True,
                         name=f"stderr-{self.name}").start()
        child.close()
        self.ctl = parent
        parent.setblocking(False)
        loop.add_reader(parent, self._on_readable)
        self.spec = RootSpec.default(self.uid, self.gid, self.settings.extra_binds)
        send_msg(parent, {"root": self.spec.to_json(), "map_self": self.map_self, "preload": list(preload),
                          "warmup": list(warmup), "prefork": not self.sessions,
                          "child": self._child_config()})
        await self._expect("unshared")
        self._set_oom_floor()
        run_procs: list[int] = []
        if self.cgroups is not None:
            memory = (self.cgroup_memory_mb + ZYGOTE_OVERHEAD_MB) * MB
            run_memory = None if self.sessions else self.settings.default_memory_mb * MB
            self.cgroups.make(self.cgroup, memory, self.cgroup_pids, run_memory)
            self.cgroups.attach(self.cgroup, self.proc.pid)
            if run_memory is not None:
                run_procs.append(self.cgroups.open_run_procs(self.cgroup))
                self._memory_limit = self.settings.default_memory_mb
        if not self.map_self:
            for name in ("uid_map", "gid_map"):  # a range: every uid inside is an unused uid outside
                with open(f"/proc/{self.proc.pid}/{name}", "w") as f:
                    f.write(f"0 {self.uid_base} 65536")
        try:
            send_msg(parent, {"op": "mapped"}, run_procs)
        finally:
            for fd in run_procs:
                os.close(fd)
        ready = await self._expect("ready")
        self.zygote_pid = next(iter(_children(self.proc.pid)), None)
        if ready.get("missing"):
            log.warning("sandbox worker %s could not pre-import: %s", self.name, "; ".join(ready["missing"]))
        self.alive = True

    def _set_oom_floor(self) -> None:
        """Make oom_score_adj 1000 a floor for every process of this worker, so a program cannot lower
        the score its process sets (program.py) and the kernel's OOM killer takes it before the server.

        Only a write by a holder of CAP_SYS_RESOURCE in the host's user namespace sets a task's
        oom_score_adj_min (which children inherit, and below which no process without that capability,
        in whatever namespace, can go); nothing inside the worker's user namespace holds it. So the
        server writes it, to the launcher, before the launcher forks the zygote. The zygote and the
        supervisors get the floor too: they are disposable (the pool replaces a dead zygote), the server
        is not. A server without the capability leaves the score to the programs, which can then lower
        it again down to the server's own floor."""
        assert self.proc is not None
        if not holds_capability(CAP_SYS_RESOURCE):
            return
        try:
            with open(f"/proc/{self.proc.pid}/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError as e:
            log.warning("sandbox worker %s: could not set oom_score_adj of %d to 1000 (expected a writable "
                        "/proc/<pid>/oom_score_adj): %s", self.name, self.proc.pid, e)

    def _child_config(self) -> dict[str, Any]:
        """What every child of this zygote shares; a run worker's children drop privileges ahead."""
        limits = limits_for(self.settings, self.settings.default_run_timeout_s, self.settings.default_memory_mb,
                            self.map_self, self.memory_cgroup)
        return {"disk_mb": self.settings.disk_mb, "limits": limits, "map_self": self.map_self,
                "uid": None if self.sessions else self.uid, "tmp_binds": self.spec.tmp_binds}

    @property
    def memory_cgroup(self) -> bool:
        """Whether a run (the worker's `run` group) or a session (a group each) of this zygote has a memory
        cgroup of its own; else RLIMIT_AS bounds memory."""
        return self.cgroups is not None

    async def _expect(self, op: str) -> dict[str, Any]:
        msg = await asyncio.wait_for(self._inbox.get(), STARTUP_TIMEOUT_S)
        if msg is None or msg.get("op") == "failed":
            detail = (msg or {}).get("message", "the zygote exited during startup")
            log.error("zygote %s failed to start: %s\n%s", self.name, detail, (msg or {}).get("trace", ""))
            raise RuntimeError(f"sandbox worker {self.name} failed to start: {detail}")
        if msg.get("op") != op:
            raise RuntimeError(f"sandbox worker {self.name}: expected {op!r}, got {msg!r}")
        return msg

    def _on_readable(self) -> None:
        assert self.ctl is not None
        try:
            msg, fds = recv_msg(self.ctl)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = None, []
        op = msg.get("op") if msg is not None else None
        if op == "spare" and fds:  # a prepared child's channel: the next run goes to it directly
            self._drop_spare()
            self._spare = (msg["key"], socket.socket(fileno=fds.pop(0)))
        for fd in fds:
            os.close(fd)
        if msg is None:
            self._mark_dead()
        elif op == "spare_gone":
            if self._spare is not None and self._spare[0] == msg["key"]:
                self._drop_spare()
        elif op == "exit":
            waiter = self._exits.pop(msg["id"], None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif op != "spare":
            self._inbox.put_nowait(msg)

    def _drop_spare(self) -> None:
        if self._spare is not None:
            self._spare[1].close()
            self._spare = None

    def _mark_dead(self) -> None:
        self._drop_spare()
        if self.ctl is not None:
            asyncio.get_running_loop().remove_reader(self.ctl)
        was_alive, self.alive = self.alive, False
        if was_alive:
            log.warning("sandbox worker %s exited", self.name)
            if self.on_death is not None:
                self.on_death(self)
        self._inbox.put_nowait(None)
        for waiter in self._exits.values():
            if not waiter.done():
                waiter.set_exception(ZygoteDied(f"sandbox worker {self.name} died"))
        self._exits.clear()

    def spawn(self, msg: dict[str, Any], fds: list[int], uid: int | None = None,
              ) -> asyncio.Future[dict[str, Any]]:
        """Hand a run (or session) to the zygote; the future resolves with the child's exit report."""
        if not self.alive or self.ctl is None:
            raise ZygoteDied(f"sandbox worker {self.name} is not running")
        waiter = asyncio.get_running_loop().create_future()
        self._exits[msg["id"]] = waiter
        uid = self.uid if uid is None or self.map_self else uid
        msg = {**msg, "uid": uid, "gid": uid, "map_self": self.map_self}
        if self._spare is not None:  # straight to the prepared child, then tell the zygote
            key, channel = self._spare
            self._spare = None
            try:
                send_msg(channel, msg, fds)
            except OSError:  # it died preparing; the zygote forks another one
                channel.close()
            else:
                channel.close()
                self._control_blocking({"op": msg["op"], "id": msg["id"], "timeout": msg.get("timeout"),
                                        "spare": key})
                return waiter
        self._control_blocking(msg, fds)
        return waiter

    def _control_blocking(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        assert self.ctl is not None
        self.ctl.setblocking(True)  # a short control packet; never blocks for long
        try:
            send_msg(self.ctl, msg, fds)
        finally:
            self.ctl.setblocking(False)

    def host_uid(self, inside_uid: int) -> int | None:
        """The host uid behind an inside uid (None in the single-uid fallback: it is ours)."""
        return None if self.map_self else self.uid_base + inside_uid

    def control(self, msg: dict[str, Any]) -> None:
        if self.alive and self.ctl is not None:
            try:
                send_msg(self.ctl, msg)
            except OSError as e:
                log.warning("control message to %s failed: %s", self.name, e)

    def set_memory_limit(self, memory_mb: int) -> None:
        """The next run's memory budget on this worker's `run` cgroup (written only when it changes)."""
        if not self.memory_cgroup or self.sessions or memory_mb == self._memory_limit:
            return
        assert self.cgroups is not None
        try:
            self.cgroups.set_run_memory(self.cgroup, memory_mb * MB)
            self._memory_limit = memory_mb
        except OSError as e:  # EBUSY: usage above the new cap (still being freed); the worker's cap holds
            log.info("cgroup memory limit of %s not lowered to %d MB: %s", self.name, memory_mb, e)

    async def stop(self) -> None:
        self.alive = False  # deliberate: no "exited" warning
        if self.ctl is not None:
            self._mark_dead()
            self.ctl.close()
            self.ctl = None
        loop = asyncio.get_running_loop()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()  # the launcher's death kills the zygote (PDEATHSIG), PID 1 of the rest
            await loop.run_in_executor(None, self.proc.wait)
            if self.zygote_pid is not None:  # reparented to us (a subreaper): reap it, no zombie left
                await loop.run_in_executor(None, _reap, self.zygote_pid)
        if self.cgroups is not None:
            self.cgroups.remove(self.cgroup)


def holds_capability(cap: int) -> bool:
    """Whether this process has capability number `cap` in its effective set (in its user namespace)."""
    with open("/proc/self/status") as f:
        effective = next(line.split()[1] for line in f if line.startswith("CapEff:"))
    return bool(int(effective, 16) >> cap & 1)


def _forward_stderr(stream: Any, name: str) -> None:
    """The zygote tree's diagnostics (a run or session that failed to start) into the server's log,
    until the last process holding the pipe is gone."""
    with stream:
        for line in stream:
            log.warning("sandbox worker %s: %s", name, line.decode(errors="replace").rstrip())


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _reap(pid: int) -> None:
    """Wait for an orphaned zygote (dying of PDEATHSIG); SIGKILL it if it takes more than 5 s."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # not ours (no subreaper, or reaped already): nothing to do
        if done:
            return
        if time.monotonic() > deadline:  # still our unreaped child, so the pid cannot be reused
            os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.01)


def claim_uid_block(first: int, blocks: int = 4096) -> tuple[int, int]:
    """(base, lock descriptor): a block of 65536 host uids, from `first` on, that no other sandbox service
    on this host holds, so that two services never share a run's host uid (per-uid kernel state such as
    process counts and keys would be shared). The block is held by an flock on a file named after it for
    as long as the descriptor stays open (the life of the service)."""
    directory = "/run/lock" if os.access("/run/lock", os.W_OK) else tempfile.gettempdir()
    for k in range(blocks):
        base = first + k * 65536
        fd = os.open(os.path.join(directory, f"agentrl-sandbox-uids-{base}.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return base, fd
    raise RuntimeError(f"all {blocks} host uid blocks from {first} are held by other sandbox services")


def become_subreaper() -> None:
    """Orphaned zygotes (their launcher killed) become our children, so we reap them promptly; under
    a lazy init they would otherwise stay zombies and keep their cgroup from being removed."""
    libc.prctl(libc.PR_SET_CHILD_SUBREAPER, 1)


