"""A run's supervisor: PID 1 of the run's own PID namespace, forked from the zygote (zygote.py).

The supervisor is the only process of a run that speaks for it, and the program cannot reach it: it keeps
the zygote's uid (root of the worker's user namespace, which the program's uid cannot signal or ptrace),
it installs no signal handler during a run (so, as PID 1, it ignores every signal the program sends), and
the program never holds its socket to the server. It is forked *ahead* of its run and prepares what does
not depend on the request: fresh mount, IPC and network namespaces (the network one with only a
loopback interface, up), a size-limited tmpfs on /tmp holding the working dir /tmp/work, the binds the
root view has under /tmp made again on top of it, a fresh /proc (`_mount`); meanwhile the program forker
(forker.py) forks the program's process into these namespaces at its request (`_fork_program`), which
drops its privileges and then waits too. The supervisor is a fork of the lean zygote, the program's
process one of the forker's preloaded interpreter: no run forks the large image twice.

When the run arrives (`_run`) it reads the request from the server's socket, hands it with the run's
stdout/stderr to the program, and watches: the program tells it once that it starts (then closes its
last line to the supervisor), and its exit status comes from the forker (its parent), or the supervisor
kills it at its deadline. Then the supervisor kills and reaps every process left in the namespace, reads
the fetched files as the run's user (resolved beneath the run's /tmp, never through a link out of it: a
link to /proc/self/fd/N would otherwise reach the supervisor's own descriptors), and only then writes the
report: status, return code, time and files are what it observed itself or learnt from the forker. A
session (`_session`) gets a program process with the session's uid that keeps the socket and serves
calls; the supervisor forwards the server's interrupts to it and outlives it only to kill what it left
behind.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import select
import selectors
import signal
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from sandbox import forker, libc, program
from sandbox.program import SETUP_FAILED, WORKDIR
from sandbox.wire import read_all_fd, recv_msg, send_msg, write_all_fd

KILLED_WAIT_S = 10.0  # for a SIGKILLed program to be gone; only a process stuck in the kernel takes long


@dataclass
class _Program:
    channel: socket.socket  # ours; the program closes its end once it starts
    pid: int = 0  # in our PID namespace, as the program's process reported it while it was still ours
    pidfd: int = -1  # its exit, seen at once (the status comes from the forker, its parent)


def main(static: dict[str, Any], channel: int, inherited: list[int], forker_fd: int) -> NoReturn:
    """Entry point right after the zygote's fork; never returns. `forker_fd`: our line to the program forker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no handler (Python's raises KeyboardInterrupt): PID 1
    fork = socket.socket(fileno=forker_fd)
    try:
        for fd in inherited:
            os.close(fd)
        # IPC and network: SysV objects, abstract sockets, ports and TIME_WAIT entries of one run are not
        # there for the next one of this worker.
        libc.unshare(libc.CLONE_NEWNS | libc.CLONE_NEWIPC | libc.CLONE_NEWNET)
        prepared = _fork_program(fork, static["uid"]) if static["uid"] is not None else None
        _mount(static)
        if prepared is not None:
            _release(prepared, static["uid"])
    except BaseException as e:  # noqa: BLE001 - the zygote sees the exit and forks a fresh one
        os.write(2, f"sandbox: preparing a run failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    chan = socket.socket(fileno=channel)
    msg, fds = recv_msg(chan)  # blocks until the run (or session) arrives
    chan.close()
    if msg is None:
        _kill_all()
        os._exit(0)
    if msg["op"] == "session":
        _session(static, fork, msg, fds)
    assert prepared is not None
    _run(static, fork, prepared, msg, fds)


def _mount(static: dict[str, Any]) -> None:
    """The run's /tmp (with the binds the root view has there made again on top), /proc, loopback."""
    covered = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in static["tmp_binds"]}
    disk_mb = static["disk_mb"]
    libc.mount("tmpfs", "/tmp", "tmpfs", libc.MS_NOSUID | libc.MS_NODEV,
               f"size={disk_mb}m,nr_inodes={inodes_for(disk_mb)},mode=1777")
    for path, fd in covered.items():  # read-only binds keep their flags when bound again
        program.makedirs(path, 0o755)
        libc.mount(f"/proc/self/fd/{fd}", path, None, libc.MS_BIND | libc.MS_REC)
        os.close(fd)
    libc.mount("proc", "/proc", "proc", libc.MS_NOSUID | libc.MS_NODEV | libc.MS_NOEXEC)
    os.mkdir(WORKDIR, 0o755)
    libc.loopback_up()


def inodes_for(disk_mb: int) -> int:
    """Inodes of a run's tmpfs (files and directories it may hold); server.py checks requests against it."""
    return max(1024, disk_mb * 64)


def _fork_program(fork: socket.socket, uid: int, cgroup_fd: int | None = None) -> _Program:
    """Have the program forker fork the program's process into our PID namespace; it joins our mount, IPC
    and network namespaces, prepares itself, then waits for `_release`. `cgroup_fd`: a session's own
    memory group, which the process joins while preparing (a run's comes with the forker's config)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    names = ["pid", *(name for name, _ in forker.JOINED)]
    namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY | os.O_CLOEXEC) for name in names]
    try:
        own_group = cgroup_fd is not None
        send_msg(fork, {"op": "fork", "uid": uid, "own_group": own_group},
                 [theirs.fileno(), *namespaces, *([cgroup_fd] if own_group else [])])
    finally:
        theirs.close()
        for fd in namespaces:
            os.close(fd)
    return _Program(ours)


def _release(prog: _Program, uid: int) -> None:
    """The run's /tmp is mounted: hand the working dir to the program's uid, wait until it is ready."""
    os.chown(WORKDIR, uid, uid)
    send_msg(prog.channel, {"op": "mounted"})
    ready, _ = recv_msg(prog.channel)
    if ready is None or ready.get("op") != "ready":
        raise RuntimeError("the program's process died while preparing")
    prog.pid = int(ready["pid"])
    prog.pidfd = os.pidfd_open(prog.pid)  # it is alive and waiting: the pid is its own


def _exit_code(fork: socket.socket) -> int:
    """The program's exit status, which the forker (its parent) sends once it has exited."""
    msg, _ = recv_msg(fork)
    if msg is None or msg.get("op") != "exit":
        raise RuntimeError("the program forker is gone")
    return int(msg["code"])


def _run(static: dict[str, Any], fork: socket.socket, prog: _Program, msg: dict[str, Any], fds: list[int]) -> NoReturn:
    sock = fds[0]
    limits = msg["limits"]
    request: dict[str, Any] = {}
    try:
        if select.select([prog.pidfd], [], [], 0)[0]:  # it died while it waited (the run before us OOMed)
            _exit_code(fork)
            prog = _fork_program(fork, static["uid"])
            _release(prog, static["uid"])
        raw = read_all_fd(sock, limits["request_bytes"])
        request = json.loads(raw)
        memfd = os.memfd_create("request", os.MFD_CLOEXEC)
        write_all_fd(memfd, raw)
        send_msg(prog.channel, {"op": "run", "lang": msg["lang"], "limits": limits}, [memfd, *fds[1:]])
        os.close(memfd)
        report = _watch(prog, fork, msg["timeout"], msg["lang"])
    except (OSError, ValueError, RuntimeError) as e:
        report = {"status": "error", "error": f"sandbox setup failed: {type(e).__name__}: {e}"}
    for fd in fds[1:]:
        os.close(fd)  # only the program's processes hold its output now: EOF once they are dead
    _kill_all(prog)
    _become_run_user(static)  # fetched files are read with the program's own permissions
    if report["status"] in ("finished", "timeout"):
        report["files"], report["fetch_skipped"], report["fetch_refused"] = _fetch(
            request.get("fetch_files") or [], limits["fetch_bytes"])
    try:
        write_all_fd(sock, json.dumps(report).encode())
    except OSError:
        pass  # the server stopped listening (client gone)
    os._exit(0)


def _watch(prog: _Program, fork: socket.socket, timeout: float, lang: str) -> dict[str, Any]:
    """Until the program exits or its deadline: the program's one message, then its exit status."""
    sel = selectors.DefaultSelector()
    sel.register(prog.channel, selectors.EVENT_READ)
    sel.register(prog.pidfd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout  # the setup (writing the files) gets the run's time too
    started: float | None = None
    while True:
        events = sel.select(max(0.0, deadline - time.monotonic()))
        now = time.monotonic()
        if not events:
            os.kill(prog.pid, signal.SIGKILL)
            return {"status": "timeout", "time": now - (started or now)}
        # The message first: "started" (or a setup failure) comes before the exit it may be seen with.
        if any(key.fileobj is prog.channel for key, _ in events):
            reply, _ = recv_msg(prog.channel)
            if reply is None:  # the program closed its end (it started, or it died)
                sel.unregister(prog.channel)
            elif reply.get("op") == "started" and started is None:
                started = now
                deadline = now + timeout
            elif reply.get("op") in ("refused", "failed") and started is None:
                return {"status": "refused" if reply["op"] == "refused" else "error",
                        "error": str(reply.get("error"))}
        if any(key.fd == prog.pidfd for key, _ in events):
            code = _exit_code(fork)
            if started is None:
                return {"status": "error", "error": "the program's process died while setting up the run"}
            if lang == "bash" and code < 0:
                code = 128 - code  # killed by a signal: the shell's 128+N convention
            return {"status": "finished", "code": code, "time": now - started}


def _kill_all(prog: _Program | None = None) -> None:
    """As PID 1: kill every other process of the namespace and reap them, so none outlives the run. The
    program's process is the forker's child, not ours: we wait until it has died (its children are then
    ours, and reaped here too)."""
    try:
        os.kill(-1, signal.SIGKILL)  # a fork racing with this fails: its parent has SIGKILL pending
    except ProcessLookupError:
        pass
    if prog is not None and prog.pidfd >= 0:
        select.select([prog.pidfd], [], [], KILLED_WAIT_S)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _become_run_user(static: dict[str, Any]) -> None:
    if static["map_self"]:
        libc.drop_all_capabilities()
    else:
        uid = static["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _fetch(paths: list[str], budget: int) -> tuple[dict[str, str], dict[str, int], dict[str, str]]:
    """The requested files that exist as regular files in the run's /tmp (relative paths from the working
    dir), up to `budget` bytes together; also those left out for the budget, with their sizes, and those
    refused for a link out of the run's /tmp, with why. Others (missing, not regular, outside /tmp,
    unreadable) are left out silently, as SandboxFusion does.

    We run as the program's user, but a path is still resolved beneath the run's /tmp only: a link the
    program left (to /proc/self/fd/N, which would be *our* descriptors, or to any absolute path, or `..`
    out of /tmp) is refused, never followed."""
    files: dict[str, str] = {}
    skipped: dict[str, int] = {}
    refused: dict[str, str] = {}
    tmp = os.open("/tmp", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in paths:
            path = os.path.normpath(os.path.join(WORKDIR, name))
            if name in files or not path.startswith("/tmp/"):
                continue
            try:  # non-blocking and regular files only: a FIFO or a device never stalls or floods the report
                fd = libc.open_beneath(tmp, path[len("/tmp/"):], os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            except ValueError:  # a NUL byte in the name
                continue
            except OSError as e:
                if e.errno == errno.EXDEV:
                    refused[name] = "a link that leads out of the run's /tmp"
                elif e.errno == errno.ELOOP:
                    refused[name] = "a /proc magic link, or a loop of links"
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    continue
                if st.st_size > budget:
                    skipped[name] = st.st_size
                    continue
                data = _read_up_to(fd, budget + 1)
                if len(data) > budget:  # grew meanwhile: impossible once the run is dead, but cheap to check
                    skipped[name] = len(data)
                    continue
                budget -= len(data)
                files[name] = base64.b64encode(data).decode()
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(tmp)
    return files, skipped, refused


def _read_up_to(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit and (chunk := os.read(fd, min(limit - total, 1 << 24))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _session(static: dict[str, Any], fork: socket.socket, msg: dict[str, Any], fds: list[int]) -> NoReturn:
    """A session: its program process gets the socket; the server's interrupts are passed on to it. After
    the socket and stdio, `fds` may hold the session's memory group (sessions.py), joined as it prepares."""
    try:
        prog = _fork_program(fork, msg["uid"], fds[3] if msg["limits"]["cgroup_memory"] else None)
        _release(prog, msg["uid"])
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox: starting a session failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    signal.signal(signal.SIGINT, lambda signum, frame: os.kill(prog.pid, signal.SIGINT))
    send_msg(prog.channel, {"op": "session", "limits": msg["limits"]}, fds[:3])
    for fd in fds:
        os.close(fd)
    prog.channel.close()
    try:
        code = _exit_code(fork)
    except RuntimeError:
        code = -signal.SIGKILL
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program is gone: its pid is no longer ours to signal
    _kill_all()
    os._exit(128 - code if code < 0 else code & 0xFF)
