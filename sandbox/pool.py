"""The server's side of the zygotes: start them, talk to them, keep a pool of idle workers.

`Zygote` owns one zygote process tree (zygote.py): it spawns the launcher with a scrubbed environment,
puts it in its cgroup, writes its uid/gid maps (when the server is root), and then exchanges control
messages with it on a SEQPACKET socket read from the event loop. A run worker's zygote also sends the
channel of the child it prepared ahead, so a run is handed to that child directly (the zygote is told
afterwards and starts the deadline): one process hop less on every request. `WorkerPool` holds the run
workers:
one run at a time per worker, a bounded queue in front (full -> `Overloaded`, which server.py turns into
503), and a dead worker is replaced in the background. run.py drives one run on a worker; sessions.py
uses a dedicated zygote of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from sandbox import libc
from sandbox.cgroups import CgroupSet
from sandbox.child import run_environment
from sandbox.rootfs import RootSpec
from sandbox.run import Job, Outcome, ZygoteDied, execute, limits_for
from sandbox.settings import MB, Settings
from sandbox.wire import recv_msg, send_msg

log = logging.getLogger("sandbox.pool")

# The zygote's whole environment, which is also every run's: runs can read it back from
# /proc/self/environ, and it holds nothing of the server's.
ZYGOTE_ENV = run_environment(sys.prefix)
BOOT = "from sandbox.zygote import main; main()"
STARTUP_TIMEOUT_S = 180.0
ZYGOTE_OVERHEAD_MB = 384  # the zygote's own resident memory, counted in its cgroup next to the run's


class Overloaded(Exception):
    """Every worker is busy and the queue is full (or waiting took too long)."""


class Zygote:
    def __init__(self, name: str, inside_uid: int, settings: Settings, cgroups: CgroupSet | None,
                 sessions: bool = False, cgroup_memory_mb: int | None = None, cgroup_pids: int | None = None,
                 ) -> None:
        self.name = name
        self.cgroup_memory_mb = cgroup_memory_mb or settings.max_memory_mb
        self.cgroup_pids = (cgroup_pids or settings.max_processes) + 16
        self.sessions = sessions  # the sessions' zygote: children on demand, each in its own netns
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
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        child.close()
        self.ctl = parent
        parent.setblocking(False)
        loop.add_reader(parent, self._on_readable)
        spec = RootSpec.default(self.uid, self.gid, self.settings.extra_binds)
        send_msg(parent, {"root": spec.to_json(), "map_self": self.map_self, "preload": list(preload),
                          "warmup": list(warmup), "prefork": not self.sessions,
                          "child": self._child_config()})
        await self._expect("unshared")
        if self.cgroups is not None:
            memory = (self.cgroup_memory_mb + ZYGOTE_OVERHEAD_MB) * MB
            self.cgroups.make(self.name, memory, self.cgroup_pids)
            self.cgroups.attach(self.name, self.proc.pid)
            self._memory_limit = self.cgroup_memory_mb
        if not self.map_self:
            base = self.settings.uid_base
            for name in ("uid_map", "gid_map"):  # a range: every uid inside is an unused uid outside
                with open(f"/proc/{self.proc.pid}/{name}", "w") as f:
                    f.write(f"0 {base} 65536")
        send_msg(parent, {"op": "mapped"})
        ready = await self._expect("ready")
        self.zygote_pid = next(iter(_children(self.proc.pid)), None)
        if ready.get("missing"):
            log.warning("sandbox worker %s could not pre-import: %s", self.name, "; ".join(ready["missing"]))
        self.alive = True

    def _child_config(self) -> dict[str, Any]:
        """What every child of this zygote shares; a run worker's children drop privileges ahead."""
        limits = limits_for(self.settings, self.settings.default_run_timeout_s, self.settings.default_memory_mb,
                            self.map_self)
        return {"network_ns": self.sessions, "disk_mb": self.settings.disk_mb, "limits": limits,
                "uid": None if self.sessions else self.uid, "gid": self.gid, "map_self": self.map_self}

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
        return None if self.map_self else self.settings.uid_base + inside_uid

    def control(self, msg: dict[str, Any]) -> None:
        if self.alive and self.ctl is not None:
            try:
                send_msg(self.ctl, msg)
            except OSError as e:
                log.warning("control message to %s failed: %s", self.name, e)

    def set_memory_limit(self, memory_mb: int) -> None:
        """Per-run memory cap of this worker's cgroup (written only when it changes)."""
        if self.cgroups is None or memory_mb == self._memory_limit:
            return
        try:
            self.cgroups.set_memory(self.name, (memory_mb + ZYGOTE_OVERHEAD_MB) * MB)
            self._memory_limit = memory_mb
        except OSError as e:  # EBUSY: usage above the new cap; rlimits still bound the run
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
            self.cgroups.remove(self.name)


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


def become_subreaper() -> None:
    """Orphaned zygotes (their launcher killed) become our children, so we reap them promptly; under
    a lazy init they would otherwise stay zombies and keep their cgroup from being removed."""
    libc.prctl(libc.PR_SET_CHILD_SUBREAPER, 1)


class WorkerPool:
    def __init__(self, settings: Settings, cgroups: CgroupSet | None) -> None:
        self.settings = settings
        self.cgroups = cgroups
        self.workers: list[Zygote] = []
        self.idle: asyncio.Queue[Zygote] = asyncio.Queue()
        self.waiting = 0
        self._respawns: set[asyncio.Task[None]] = set()
        self._replacing: set[Zygote] = set()

    def _new(self, index: int) -> Zygote:
        worker = Zygote(f"worker{index}", self.settings.run_uid + index, self.settings, self.cgroups)
        worker.on_death = self._replace
        return worker

    async def start(self) -> None:
        self.workers = [self._new(i) for i in range(self.settings.workers)]
        await asyncio.gather(*(w.start(self.settings.preload, WARMUP) for w in self.workers))
        for worker in self.workers:
            self.idle.put_nowait(worker)

    async def acquire(self) -> Zygote:
        while not self.waiting and not self.idle.empty():  # fast path: a worker is free, nobody waits
            worker = self.idle.get_nowait()
            if worker.alive:
                return worker
            self._replace(worker)
        if self.waiting >= self.settings.max_queue:
            raise Overloaded(f"{self.settings.max_queue} runs are already waiting for a worker")
        self.waiting += 1
        try:
            while True:
                getter = asyncio.ensure_future(self.idle.get())
                try:
                    done, _ = await asyncio.wait([getter], timeout=self.settings.queue_timeout_s)
                except asyncio.CancelledError:  # the client left while queued: keep the worker
                    self._give_back(getter)
                    raise
                if not done:
                    self._give_back(getter)
                    raise Overloaded(f"no worker became free within {self.settings.queue_timeout_s:g} s")
                worker = getter.result()
                if worker.alive:
                    return worker
                self._replace(worker)
        finally:
            self.waiting -= 1

    def _give_back(self, getter: asyncio.Future[Zygote]) -> None:
        """A queue.get() that completed as we gave up on it must not lose its worker."""
        if getter.done() and not getter.cancelled():
            self.idle.put_nowait(getter.result())
        else:
            getter.cancel()

    async def run(self, job: Job) -> Outcome:
        worker = await self.acquire()
        return await execute(worker, job, self.settings, self.release)

    def release(self, worker: Zygote) -> None:
        if worker.alive:
            self.idle.put_nowait(worker)
        else:
            self._replace(worker)

    def _replace(self, dead: Zygote) -> None:
        if dead in self._replacing:
            return
        self._replacing.add(dead)
        task = asyncio.create_task(self._respawn(dead))
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _respawn(self, dead: Zygote) -> None:
        await dead.stop()
        if dead not in self.workers:  # replaced already (it died, then was also found dead in the queue)
            self._replacing.discard(dead)
            return
        index = self.workers.index(dead)
        delay = 0.5
        while True:
            fresh = self._new(index)
            try:
                await fresh.start(self.settings.preload, WARMUP)
            except asyncio.CancelledError:  # the service is stopping
                await fresh.stop()
                raise
            except Exception as e:  # noqa: BLE001 - keep trying; /health shows the worker missing
                log.error("restarting %s failed: %s", fresh.name, e)
                await fresh.stop()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self.workers[index] = fresh
            self._replacing.discard(dead)
            self.idle.put_nowait(fresh)
            return

    def status(self) -> dict[str, int]:
        alive = sum(w.alive for w in self.workers)
        oom = sum(self.cgroups.oom_kills(w.name) for w in self.workers) if self.cgroups else 0
        idle = sum(w.alive for w in self.idle._queue)  # type: ignore[attr-defined]  # dead ones wait there too
        return {"workers": len(self.workers), "alive": alive, "idle": idle,
                "queued": self.waiting, "oom_kills": oom}

    async def stop(self) -> None:
        for task in list(self._respawns):
            task.cancel()
        await asyncio.gather(*(w.stop() for w in self.workers), return_exceptions=True)


# Lazily imported sympy submodules (printing, simplification) pulled in once in the zygote.
WARMUP = ("import sympy; sympy.simplify(sympy.sin(sympy.Symbol('x'))**2 + sympy.cos(sympy.Symbol('x'))**2); "
          "str(sympy.Rational(1, 3) + sympy.sqrt(2))",)
