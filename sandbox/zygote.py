"""The zygote: a pre-started, pre-confined Python that forks one child per run (or per session).

pool.py starts it as `python -c "from sandbox.zygote import main; main()" CTL_FD SERVER_PID` with a
scrubbed environment. Two processes result:

* the launcher (host PID namespace) enters new user, mount, network, IPC, UTS and PID namespaces,
  captures host handles with the host credentials it still carries (rootfs.HostSnapshot), lets the server
  write its uid/gid maps (or writes a single-uid map itself when the server is not root), forks the
  zygote and waits for it;
* the zygote is PID 1 of that PID namespace: it becomes root of its user namespace, takes a fresh
  session keyring, builds and pivots into the read-only root (rootfs.build_root), forbids nested user
  namespaces, forks the program forker (forker.py), which pre-imports math/numpy/sympy and forks every
  program's process, then serves control messages. The zygote itself imports none of that: each run's
  supervisor is a fork of it, so a fork of a small process. A run worker keeps one child (supervisor.py,
  PID 1 of a fresh nested PID namespace, with the program's process the forker made for it there) forked
  and prepared ahead; "run" hands it the run's descriptors and starts a backstop deadline (the supervisor
  enforces the run's own timeout), and the next child is forked right away, to be prepared while that run
  goes on. The sessions' zygote forks a child per "session". "kill"/"signal" act on a child; each child's
  exit is reported with its status, whether the backstop killed it, and its wall time. If the forker dies,
  so does the zygote (and the whole worker with it: the server starts a new one).

Neither the zygote nor the forker reads a run's code, input or output (they go straight between the
server and the run's processes), so nothing of one run stays in the memory that later runs are forked
from. If the launcher or the zygote dies, PR_SET_PDEATHSIG and PID-namespace teardown kill every process
below it.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, NoReturn

# imported now: their files are not visible after pivot_root
from sandbox import forker, libc, program, supervisor
from sandbox.rootfs import HostSnapshot, RootSpec, build_root
from sandbox.wire import recv_msg, send_msg

ZYGOTE_NAMESPACES = (
    libc.CLONE_NEWUSER | libc.CLONE_NEWNS | libc.CLONE_NEWNET | libc.CLONE_NEWIPC | libc.CLONE_NEWUTS
    | libc.CLONE_NEWPID
)


def main() -> NoReturn:
    """The launcher's entry point."""
    ctl = socket.socket(fileno=int(sys.argv[1]))
    libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[2]):  # the server died before we could arm PDEATHSIG
        os._exit(1)
    try:
        config, _ = recv_msg(ctl)
        if config is None:
            os._exit(1)
        host_uid, host_gid = os.getuid(), os.getgid()
        libc.unshare(ZYGOTE_NAMESPACES)
        # Captured inside the new mount namespace (a bind source must belong to it) but with the host
        # credentials we still carry, which can traverse paths such as a 0700 /root.
        snap = HostSnapshot.capture(RootSpec(**config["root"]))
        send_msg(ctl, {"op": "unshared"})
        reply, fds = recv_msg(ctl)  # with the run cgroup's cgroup.procs, opened by the server
        if reply is None:
            os._exit(1)
        config["child"]["cgroup_fd"] = fds[0] if fds else None
        if config["map_self"]:  # unprivileged server: only our own uid can be mapped (to 0 inside)
            libc.map_self_to_root(host_uid, host_gid)
        pid = os.fork()
        if pid == 0:
            _zygote_main(ctl, config, snap)
    except BaseException as e:  # noqa: BLE001 - anything here is a startup failure the server must see
        _startup_failed(ctl, e)
    ctl.close()
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _startup_failed(ctl: socket.socket, exc: BaseException) -> NoReturn:
    message = f"{type(exc).__name__}: {exc}"
    try:
        send_msg(ctl, {"op": "failed", "message": message, "trace": traceback.format_exc()[-4000:]})
    finally:
        os._exit(1)


def _zygote_main(ctl: socket.socket, config: dict[str, Any], snap: HostSnapshot) -> NoReturn:
    try:
        if not config["map_self"]:
            os.setgroups([])
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        libc.prctl(libc.PR_SET_PDEATHSIG, signal.SIGKILL)  # after setresuid: credential changes clear it
        libc.prctl(libc.PR_SET_DUMPABLE, 1)  # likewise reset by setresuid; /proc/self/* must stay ours
        libc.join_new_session_keyring()  # nothing below us holds the keyring the server came with
        socket.sethostname(snap.spec.hostname)
        build_root(snap)
        # Runs may not create user namespaces of their own: no capabilities regained inside a nested
        # namespace, and much less kernel surface to probe. (The limit is per user namespace: ours.)
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")
        forker_ctl, forker_pid, missing = _start_forker(ctl, config)
        send_msg(ctl, {"op": "ready", "missing": missing})
    except BaseException as e:  # noqa: BLE001
        _startup_failed(ctl, e)
    _Zygote(ctl, config["child"], config["prefork"], forker_ctl, forker_pid).serve()


def _start_forker(ctl: socket.socket, config: dict[str, Any]) -> tuple[socket.socket, int, list[str]]:
    """Fork the program forker (forker.py), which preloads; returns our line to it, its pid and what it
    could not preload. We never import what it preloads: every supervisor is a fork of us."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            ctl.close()
            ours.close()
            forker.main(theirs, config)
        finally:
            os._exit(1)
    theirs.close()
    cgroup_fd = config["child"].get("cgroup_fd")
    if cgroup_fd is not None:  # the forker's program processes join the run cgroup with it; we never do
        os.close(cgroup_fd)
    reply, _ = recv_msg(ours)
    if reply is None or reply.get("op") != "ready":
        raise RuntimeError(f"the program forker did not start: {(reply or {}).get('message', 'it exited')}")
    gc.collect()
    gc.freeze()
    return ours, pid, reply["missing"]


@dataclass
class _Child:
    pid: int
    channel: socket.socket | None  # our end, until the run's descriptors are handed over
    key: int = 0  # names a prepared child to the server, which may hand it a run directly
    id: str | None = None  # None: forked ahead of time, waiting for a run
    started: float = 0.0
    deadline: float | None = None
    timed_out: bool = False
    killed: bool = False


class _Zygote:
    def __init__(self, ctl: socket.socket, static: dict[str, Any], prefork: bool, forker_ctl: socket.socket,
                 forker_pid: int) -> None:
        self.ctl = ctl
        self.forker = forker_ctl
        self.forker_pidfd = os.pidfd_open(forker_pid)
        self.static = static
        self.prefork = prefork
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ)
        self.sel.register(self.forker_pidfd, selectors.EVENT_READ)  # its end is ours: no runs without it
        self.children: dict[int, _Child] = {}  # pidfd -> child
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.spare: _Child | None = None
        self.spare_failures = 0
        self.keys = 0
        self.unclaimed: dict[int, int] = {}  # key -> exit status of prepared children that died
        self._replenish()

    def serve(self) -> NoReturn:
        while True:
            deadlines = [c.deadline for c in self.children.values() if c.deadline is not None]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
            # Control first: a "run" naming a prepared child must be seen before that child's exit.
            for key, _ in sorted(self.sel.select(timeout), key=lambda event: event[0].fileobj is not self.ctl):
                if key.fileobj is self.ctl:
                    self._on_control()
                elif key.fd == self.forker_pidfd:
                    os._exit(1)
                else:
                    self._on_exit(key.fd)
            now = time.monotonic()
            for c in self.children.values():
                if c.deadline is not None and now >= c.deadline:
                    c.deadline, c.timed_out = None, True
                    os.kill(c.pid, signal.SIGKILL)  # PID 1 of its namespace: takes all of it along

    def _replenish(self) -> None:
        """Fork the next run's child as soon as the last one was handed a run, so that its preparation
        overlaps that run, off the next request's path. The two share only the worker's uid and cgroup:
        each has its own PID, mount, network and IPC namespaces, so neither can see or reach the other."""
        if self.prefork and self.spare is None and self.spare_failures < 3:
            try:
                self.spare = self._fork()
            except OSError:
                self.spare_failures += 1
                return
            # The server may hand the run straight to the child, keeping us off the request's path.
            assert self.spare.channel is not None
            send_msg(self.ctl, {"op": "spare", "key": self.spare.key}, [self.spare.channel.fileno()])

    def _fork(self, held: list[int] | tuple[int, ...] = ()) -> _Child:
        """A supervisor; `held`: descriptors we received for it, which it gets again over its channel."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        to_forker, forkers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            send_msg(self.forker, {"op": "run"}, [forkers.fileno()])  # the supervisor's line to the forker
        finally:
            forkers.close()
        channels = [c.channel.fileno() for c in self.children.values() if c.channel is not None]
        inherited = [self.ctl.fileno(), self.sel.fileno(), self.own_pidns, self.forker.fileno(), self.forker_pidfd,
                     *self.children, *channels, ours.fileno(), *held]
        libc.unshare(libc.CLONE_NEWPID)  # only our next child goes there; we stay where we are
        try:
            pid = os.fork()
        except OSError:
            libc.setns(self.own_pidns, libc.CLONE_NEWPID)
            for s in (ours, theirs, to_forker):
                s.close()
            raise
        if pid == 0:
            try:  # never return into the zygote's loop, whatever the program did to the interpreter
                supervisor.main(self.static, theirs.fileno(), inherited, to_forker.fileno())
            finally:
                os._exit(program.SETUP_FAILED)
        libc.setns(self.own_pidns, libc.CLONE_NEWPID)
        theirs.close()
        to_forker.close()
        pidfd = os.pidfd_open(pid)
        self.keys += 1
        new = self.children[pidfd] = _Child(pid, ours, self.keys)
        self.sel.register(pidfd, selectors.EVENT_READ)
        return new

    def _on_control(self) -> None:
        msg, fds = recv_msg(self.ctl)
        if msg is None:  # the server is gone; as PID 1 our exit kills every child
            os._exit(0)
        op = msg["op"]
        if op in ("run", "session"):
            self._start(msg, fds)
            return
        target = next((c for c in self.children.values() if c.id == msg["id"]), None)
        if target is None:
            return  # already exited; its exit message is on its way
        if op == "kill":
            target.killed = True
            os.kill(target.pid, signal.SIGKILL)
        elif op == "signal":
            os.kill(target.pid, int(msg["signal"]))

    def _start(self, msg: dict[str, Any], fds: list[int]) -> None:
        if "spare" in msg:  # the server already gave the run to that prepared child
            self._claimed(msg)
            return
        try:
            c = self.spare or self._fork(fds)
        except OSError as e:
            for fd in fds:
                os.close(fd)
            send_msg(self.ctl, {"op": "exit", "id": msg["id"], "code": None, "error": f"fork failed: {e}"})
            return
        if c is self.spare:  # the server may hold its channel too: it must not use it any more
            send_msg(self.ctl, {"op": "spare_gone", "key": c.key})
        self.spare = None
        assert c.channel is not None
        try:
            send_msg(c.channel, msg, fds)
        except OSError:
            pass  # the child died preparing; its exit (reported below) fails the run
        for fd in fds:
            os.close(fd)
        self._assign(c, msg)
        self._replenish()

    def _claimed(self, msg: dict[str, Any]) -> None:
        c = next((c for c in self.children.values() if c.key == msg["spare"] and c.id is None), None)
        if c is None:  # it exited before this notice arrived: its status is the run's
            code = self.unclaimed.pop(msg["spare"], None)
            send_msg(self.ctl, {"op": "exit", "id": msg["id"], "code": code, "timed_out": False,
                                "killed": False, "elapsed": 0.0,
                                **({"error": "the prepared child was lost"} if code is None else {})})
            return
        if c is self.spare:
            self.spare = None
        self._assign(c, msg)
        self._replenish()

    @staticmethod
    def _assign(c: _Child, msg: dict[str, Any]) -> None:
        """`c` now runs `msg`'s run: its id, start and deadline; our end of its channel is closed."""
        backstop = msg.get("backstop")
        c.id, c.started = msg["id"], time.monotonic()
        c.deadline = c.started + backstop if backstop else None
        if c.channel is not None:
            c.channel.close()
            c.channel = None

    def _on_exit(self, pidfd: int) -> None:
        c = self.children.pop(pidfd)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(c.pid, 0)
        if c.channel is not None:
            c.channel.close()
        if c.id is None:  # unclaimed: its preparation failed, or its run's notice is still to come
            if c is self.spare:
                self.spare = None
            self.spare_failures += 1
            self.unclaimed[c.key] = os.waitstatus_to_exitcode(status)
            while len(self.unclaimed) > 16:
                self.unclaimed.pop(next(iter(self.unclaimed)))
            send_msg(self.ctl, {"op": "spare_gone", "key": c.key})
        else:
            send_msg(self.ctl, {
                "op": "exit",
                "id": c.id,
                "code": os.waitstatus_to_exitcode(status),
                "timed_out": c.timed_out,
                "killed": c.killed,
                "elapsed": time.monotonic() - c.started,
            })
            self.spare_failures = 0
        self._replenish()
