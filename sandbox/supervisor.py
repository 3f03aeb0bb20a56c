"""A run's supervisor: PID 1 of the run's own PID namespace, forked from the zygote (zygote.py).

The supervisor is the only process of a run that speaks for it, and the program cannot reach it: it keeps
the zygote's uid (root of the worker's user namespace, which the program's uid cannot signal or ptrace),
it installs no signal handler during a run (so, as PID 1, it ignores every signal the program sends), and
the program never holds its socket to the server. It is forked *ahead* of its run and prepares what does
not depend on the request: fresh mount, IPC and network namespaces (the network one with only a
loopback interface, up), a size-limited tmpfs on /tmp holding the working dir /tmp/work, the binds the
root view has under /tmp made again on top of it, a fresh /proc (`_mount`); meanwhile the program's
process (program.py, forked first thing) drops its privileges, and then waits too.

When the run arrives (`_run`) it reads the request from the server's socket, hands it with the run's
stdout/stderr to the program, and watches: the program tells it once that it starts (then closes its
last line to the supervisor), and its exit is seen through a pidfd, or the supervisor kills it at its
deadline. Then the supervisor kills and reaps every process left in the namespace, reads the fetched
files as the run's user (resolved beneath the run's /tmp, never through a link out of it: a link to
/proc/self/fd/N would otherwise reach the supervisor's own descriptors), and only then writes the report: status, return code, time and files are what
it observed itself. A session (`_session`) gets a program process with the session's uid that keeps the
socket and serves calls; the supervisor forwards the server's interrupts to it and outlives it only to
kill what it left behind.
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

from sandbox import libc, program
from sandbox.program import SETUP_FAILED, WORKDIR
from sandbox.wire import read_all_fd, recv_msg, send_msg, write_all_fd


@dataclass
class _Program:
    pid: int
    pidfd: int
    channel: socket.socket  # ours; the program closes its end once it starts


def main(static: dict[str, Any], channel: int, inherited: list[int]) -> NoReturn:
    """Entry point right after the zygote's fork; never returns."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no handler (Python's raises KeyboardInterrupt): PID 1
    try:
        for fd in inherited:
            os.close(fd)
        # IPC and network: SysV objects, abstract sockets, ports and TIME_WAIT entries of one run are not
        # there for the next one of this worker.
        libc.unshare(libc.CLONE_NEWNS | libc.CLONE_NEWIPC | libc.CLONE_NEWNET)
        # The program's process is forked first thing: every page we touch before forking it (a write
        # splits the zygote's huge pages) is a page table the fork has to copy.
        prepared = _fork_program(static, static["uid"]) if static["uid"] is not None else None
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
        _session(static, msg, fds)
    assert prepared is not None
    _run(static, prepared, msg, fds)


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


def _fork_program(static: dict[str, Any], uid: int) -> _Program:
    """Fork the program's process; it prepares itself, then waits for `_release`."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:  # never return into the supervisor's code, whatever the program did to the interpreter
            ours.close()
            namespace = program.prepare(static, uid, theirs.fileno())
            mounted, _ = recv_msg(theirs)
            if mounted is None:
                program.exit_now(0)
            os.chdir(WORKDIR)
            send_msg(theirs, {"op": "ready"})
            _program_main(theirs, namespace)
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"sandbox: preparing the program failed: {type(e).__name__}: {e}\n".encode())
        finally:
            program.exit_now(SETUP_FAILED)
    theirs.close()  # (the cgroup's descriptor stays open: a program's process forked again joins too)
    return _Program(pid, os.pidfd_open(pid), ours)


def _release(prog: _Program, uid: int) -> None:
    """The run's /tmp is mounted: hand the working dir to the program's uid, wait until it is ready."""
    os.chown(WORKDIR, uid, uid)
    send_msg(prog.channel, {"op": "mounted"})
    ready, _ = recv_msg(prog.channel)
    if ready is None or ready.get("op") != "ready":
        raise RuntimeError("the program's process died while preparing")


def _program_main(chan: socket.socket, namespace: dict[str, Any]) -> NoReturn:
    """In the program's process: wait for the run (or session), set it up, become the program."""
    msg, fds = recv_msg(chan)
    if msg is None:
        program.exit_now(0)
    limits = msg["limits"]
    if msg["op"] == "session":
        chan.close()
        program.place_fds(fds, (program.SESSION_FD, 1, 2))
        os.set_inheritable(program.SESSION_FD, False)  # the session's own children never get the socket
        program.set_limits(limits)
        program.session_loop(namespace, limits)
    try:
        request = program.load_request(fds[0], limits["request_bytes"])
        path = program.start(request, msg["lang"], limits, fds[1:])
    except program.RequestError as e:
        send_msg(chan, {"op": "refused", "error": str(e)})
        program.exit_now(SETUP_FAILED)
    except Exception as e:  # noqa: BLE001 - the sandbox's fault: reported as such
        send_msg(chan, {"op": "failed", "error": f"sandbox setup failed: {type(e).__name__}: {e}"})
        program.exit_now(SETUP_FAILED)
    send_msg(chan, {"op": "started"})
    chan.close()  # from here on the program has no line to anyone but its own output
    args = request.get("args") or []
    if msg["lang"] == "bash":
        program.exec_bash(path, args)
    program.run_python(path, args, namespace)


def _run(static: dict[str, Any], prog: _Program, msg: dict[str, Any], fds: list[int]) -> NoReturn:
    sock = fds[0]
    limits = msg["limits"]
    request: dict[str, Any] = {}
    try:
        if select.select([prog.pidfd], [], [], 0)[0]:  # killed while it waited (the run before us OOMed)
            os.waitpid(prog.pid, 0)
            prog = _fork_program(static, static["uid"])
            _release(prog, static["uid"])
        raw = read_all_fd(sock, limits["request_bytes"])
        request = json.loads(raw)
        memfd = os.memfd_create("request", os.MFD_CLOEXEC)
        write_all_fd(memfd, raw)
        send_msg(prog.channel, {"op": "run", "lang": msg["lang"], "limits": limits}, [memfd, *fds[1:]])
        os.close(memfd)
        report = _watch(prog, msg["timeout"], msg["lang"])
    except (OSError, ValueError, RuntimeError) as e:
        report = {"status": "error", "error": f"sandbox setup failed: {type(e).__name__}: {e}"}
    for fd in fds[1:]:
        os.close(fd)  # only the program's processes hold its output now: EOF once they are dead
    _kill_all()
    _become_run_user(static)  # fetched files are read with the program's own permissions
    if report["status"] in ("finished", "timeout"):
        report["files"], report["fetch_skipped"], report["fetch_refused"] = _fetch(
            request.get("fetch_files") or [], limits["fetch_bytes"])
    try:
        write_all_fd(sock, json.dumps(report).encode())
    except OSError:
        pass  # the server stopped listening (client gone)
    os._exit(0)


def _watch(prog: _Program, timeout: float, lang: str) -> dict[str, Any]:
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
            _, status = os.waitpid(prog.pid, 0)
            if started is None:
                return {"status": "error", "error": "the program's process died while setting up the run"}
            code = os.waitstatus_to_exitcode(status)
            if lang == "bash" and code < 0:
                code = 128 - code  # killed by a signal: the shell's 128+N convention
            return {"status": "finished", "code": code, "time": now - started}


def _kill_all() -> None:
    """As PID 1: kill every other process of the namespace and reap them, so none outlives the run."""
    try:
        os.kill(-1, signal.SIGKILL)  # a fork racing with this fails: its parent has SIGKILL pending
    except ProcessLookupError:
        pass
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


def _session(static: dict[str, Any], msg: dict[str, Any], fds: list[int]) -> NoReturn:
    """A session: its program process gets the socket; the server's interrupts are passed on to it."""
    try:
        prog = _fork_program(static, msg["uid"])
        _release(prog, msg["uid"])
    except BaseException as e:  # noqa: BLE001
        os.write(2, f"sandbox: starting a session failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    signal.signal(signal.SIGINT, lambda signum, frame: os.kill(prog.pid, signal.SIGINT))
    send_msg(prog.channel, {"op": "session", "limits": msg["limits"]}, fds)
    for fd in fds:
        os.close(fd)
    prog.channel.close()
    _, status = os.waitpid(prog.pid, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the program is reaped: its pid is no longer ours
    _kill_all()
    code = os.waitstatus_to_exitcode(status)
    os._exit(128 - code if code < 0 else code & 0xFF)
