"""One confined run (or one session), in a child forked from the warm zygote (zygote.py).

The child is PID 1 of a fresh PID namespace and starts as root of the zygote's user namespace. It is
forked *ahead* of its run and prepares everything that does not depend on the request (`_prepare`):
fresh mount and IPC namespaces (plus a network namespace for sessions), a size-limited tmpfs on /tmp
holding the working dir /tmp/work, a fresh /proc, a scrubbed environment, a fresh `__main__`, and the
drop to the run's unprivileged uid with its static rlimits (in the single-uid fallback: dropping every
capability instead). Then it waits. When the zygote hands it the run's descriptors (`_start`), it reads
the request from the server's socket, writes the input files, sets the run's memory and CPU limits and
runs the code: Python in this already-warm interpreter, bash as a spawned `bash -c`. Then (`_finish`) it kills and reaps every other process of its namespace,
reports exit status and fetched files on the socket, closes its output and exits; the kernel tears the
namespaces down after it.

Sessions (sessions.py) keep the child alive and loop over length-prefixed calls, keeping one `__main__`.
"""

from __future__ import annotations

import atexit
import base64
import builtins
import ctypes
import fcntl
import io
import json
import math
import os
import resource
import signal
import socket
import sys
import threading
import time
import types
from typing import Any, NoReturn

from sandbox import libc
from sandbox.wire import encode_frame, read_all_fd, read_frame_fd, recv_msg, write_all_fd

WORKDIR = "/tmp/work"
SOCK_FD = 3  # the server's socket, at a fixed number once stdio is in place
SETUP_FAILED = 125
MB = 1024 * 1024
_dropped = False  # privileges already dropped (run workers do it before the run arrives)
_mapped = 0  # bytes the interpreter had mapped when prepared; RLIMIT_AS adds the run's budget on top


def main(static: dict[str, Any], channel: int, inherited: list[int]) -> NoReturn:
    """Entry point right after the zygote's fork; never returns."""
    try:
        namespace = _prepare(static, inherited)
    except BaseException as e:  # noqa: BLE001 - the zygote sees the exit and forks a fresh one
        os.write(2, f"sandbox: preparing a run failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    chan = socket.socket(fileno=channel)
    msg, fds = recv_msg(chan)  # blocks until the run (or session) arrives
    chan.close()  # the program never gets a line to the zygote
    if msg is None:
        os._exit(0)
    try:
        request = _start(msg, fds)
    except BaseException as e:  # noqa: BLE001 - a setup failure is the sandbox's fault: report it
        _report({"error": f"sandbox setup failed: {type(e).__name__}: {e}"})
        os._exit(SETUP_FAILED)
    if msg["op"] == "session":
        _session_loop(namespace, msg["limits"])
    started = time.monotonic()
    if msg["lang"] == "bash":
        code = _run_bash(request["code"], request.get("args") or [])
    else:
        code = _run_python(request["code"], namespace)
        _finish_python()
        if os.getpid() != 1:  # a fork of the program fell off the end of its code: just exit like it
            os._exit(code)
    _finish(code, time.monotonic() - started, request.get("fetch_files") or [], msg["limits"]["fetch_bytes"])


def _prepare(static: dict[str, Any], inherited: list[int]) -> dict[str, Any]:
    """Everything that does not depend on the request, done before it arrives. (The environment and
    the stdio objects need no work: the zygote was started with exactly the runs' environment, and its
    own stdin/stdout/stderr objects, never used, simply follow the descriptors put under them.)"""
    for fd in inherited:
        os.close(fd)
    flags = libc.CLONE_NEWNS | libc.CLONE_NEWIPC | (libc.CLONE_NEWNET if static["network_ns"] else 0)
    libc.unshare(flags)  # IPC: SysV objects of one run are invisible to the next run of this zygote
    disk_mb = static["disk_mb"]
    libc.mount("tmpfs", "/tmp", "tmpfs", libc.MS_NOSUID | libc.MS_NODEV,
               f"size={disk_mb}m,nr_inodes={max(1024, disk_mb * 64)},mode=1777")
    libc.mount("proc", "/proc", "proc", libc.MS_NOSUID | libc.MS_NODEV | libc.MS_NOEXEC)
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    os.write(fd, b"1000")  # under memory pressure the kernel kills runs first, never the zygote or server
    os.close(fd)
    os.mkdir(WORKDIR, 0o755)
    _reseed_numpy()
    compile("pass", "<string>", "exec")  # fault in the compiler's pages now, not on the request's time
    global _mapped
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    _mapped = int(os.read(fd, 64).split()[0]) * resource.getpagesize()  # the interpreter's own mappings
    os.close(fd)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main  # pickle and multiprocessing look the program's classes up here
    if static.get("uid") is not None:  # a run worker knows its uid before the run: drop privileges now
        _drop_privileges(static["uid"], static["gid"], static["map_self"], static["limits"])
    return main.__dict__


_numpy_state: int | None = None  # address of numpy's global MT19937 state, when it could be verified


def locate_numpy_state() -> None:
    """Called by the zygote after its imports. numpy.random.seed() costs a child ~0.8 ms (the first call
    touches, hence copies, many pages); writing fresh entropy straight into the generator's state
    (`key[624]`, then `pos`) costs ~0.1 ms. Used only if a test write reads back exactly."""
    global _numpy_state
    numpy = sys.modules.get("numpy")
    if numpy is None or "numpy.random" not in sys.modules:
        return
    numpy.random.seed(0)  # also clears any cached gaussian of the legacy generator
    generator = numpy.random.mtrand._rand._bit_generator
    address = generator.ctypes.state_address
    probe = bytes(range(256)) * 9 + bytes(range(192))  # 2496 bytes = 624 uint32
    ctypes.memmove(address, probe, len(probe))
    ctypes.c_int.from_address(address + len(probe)).value = 624
    state = generator.state["state"]
    if state["pos"] == 624 and bytes(numpy.asarray(state["key"], dtype="<u4").tobytes()) == probe:
        _numpy_state = address
    numpy.random.seed(0)


def _reseed_numpy() -> None:
    """Forked children would all draw the zygote's numpy sequence: give each fresh entropy."""
    if _numpy_state is not None:
        ctypes.memmove(_numpy_state, os.urandom(2496), 2496)
        ctypes.c_int.from_address(_numpy_state + 2496).value = 624  # regenerate on the next draw
    elif "numpy.random" in sys.modules:
        sys.modules["numpy"].random.seed()


def run_environment(prefix: str) -> dict[str, str]:
    """The whole environment of every run; pool.py starts the zygotes with it."""
    return {
        "PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": WORKDIR,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "SHELL": "/bin/bash",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
        # Before numpy is imported: one thread per process (a process entering a user namespace must be
        # single-threaded, and forked children would inherit idle BLAS threads).
        **{k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                            "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")},
    }


def _start(msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
    """The run has arrived: take its descriptors, read the request, set the run's own limits."""
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, 16) for target, fd in zip((SOCK_FD, 1, 2), fds, strict=True)}
    for target, fd in moved.items():
        os.dup2(fd, target)
    os.set_inheritable(SOCK_FD, False)  # the program's own children never get the report socket
    os.closerange(SOCK_FD + 1, 1024)
    limits = msg["limits"]
    if not _dropped:  # a session: its uid comes with the request
        _drop_privileges(msg["uid"], msg["gid"], msg["map_self"], limits)
    request = json.loads(read_all_fd(SOCK_FD, limits["request_bytes"])) if msg["op"] == "run" else {}
    _write_files(request.get("files") or {})
    if request.get("stdin"):
        _set_stdin(request["stdin"])
    sys.argv = ["-c", *(request.get("args") or [])]
    for kind, value in (
        # The interpreter's own mappings are not the program's: the budget comes on top of them.
        (resource.RLIMIT_AS, _mapped + 64 * MB + limits["memory_mb"] * MB),
        # soft == hard: PID 1 ignores SIGXCPU, but the hard limit's SIGKILL always lands.
        (resource.RLIMIT_CPU, math.ceil(limits["cpu_s"])),
    ):
        resource.setrlimit(kind, (value, value))
    return request


def _drop_privileges(uid: int, gid: int, map_self: bool, limits: dict[str, Any]) -> None:
    global _dropped
    _dropped = True
    os.chown(WORKDIR, uid, gid)
    if map_self:  # one uid mapped: stay uid 0 inside, but with no capabilities at all
        libc.drop_all_capabilities()
    else:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
    # setresuid made us non-dumpable, which hands /proc/self (fd, environ, ...) to the host's root:
    # the program could not even list its own descriptors. Its uid is its alone, so this exposes nothing.
    libc.prctl(libc.PR_SET_DUMPABLE, 1)
    os.chdir(WORKDIR)
    for kind, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, limits["nproc"]),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_FSIZE, limits["fsize_mb"] * MB),
        (resource.RLIMIT_MEMLOCK, 0),
    ):
        resource.setrlimit(kind, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-size writes fail with EFBIG instead of killing


def _write_files(files: dict[str, str | None]) -> None:
    for rel, content in files.items():
        if content is None:
            continue
        path = _resolve(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(content))


def _resolve(rel: str) -> str:
    path = os.path.normpath(os.path.join(WORKDIR, rel))
    if not path.startswith(WORKDIR + "/"):
        raise ValueError(f"path {rel!r} leaves the working directory")
    return path


def _set_stdin(text: str | None) -> None:
    """fd 0 becomes an in-memory file holding `text` (or /dev/null); sys.stdin is rebuilt over it."""
    if text:
        fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
        write_all_fd(fd, text.encode())
        os.lseek(fd, 0, os.SEEK_SET)
    else:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    os.dup2(fd, 0)
    os.close(fd)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")


def _run_python(code: str, namespace: dict[str, Any]) -> int:
    try:
        exec(compile(code, "<string>", "exec"), namespace)
    except SystemExit as e:
        return _exit_status(e)
    except BaseException as e:  # noqa: BLE001 - printed like the interpreter does, exit status 1
        tb = _program_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0


def _program_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without this module's frames (the exec call, the SIGINT handler)."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _finish_python() -> None:
    """What the interpreter does at exit: join non-daemon threads, run atexit, flush stdio."""
    steps = (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush)  # type: ignore[attr-defined]
    for step in steps:
        try:
            step()
        except BaseException:  # noqa: BLE001, S112 - the program's own mess; its output is already out
            continue


def _run_bash(code: str, args: list[str]) -> int:
    default = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD)
    pid = os.posix_spawn("/bin/bash", ["bash", "-c", code, "bash", *args], dict(os.environ), setsigdef=default)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128+N convention


def _kill_others() -> None:
    """As PID 1: kill every other process of the namespace and reap them, so none outlives the run."""
    for _ in range(2):  # the second pass catches children forked while the first was delivered
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break


def _finish(code: int, seconds: float, fetch: list[str], budget: int) -> NoReturn:
    _kill_others()
    for fd in (0, 1, 2):
        os.close(fd)  # EOF on the output first: when the report lands, the output is complete
    _report({"code": code, "time": seconds, "files": _fetch(fetch, budget)})
    os._exit(code)


def _fetch(paths: list[str], budget: int) -> dict[str, str]:
    files: dict[str, str] = {}
    for rel in paths:
        try:
            path = _resolve(rel)
            if os.path.isfile(path) and os.path.getsize(path) <= budget:
                with open(path, "rb") as f:
                    data = f.read(budget + 1)
                budget -= len(data)
                files[rel] = base64.b64encode(data).decode()
        except (OSError, ValueError):
            continue  # SandboxFusion semantics: a file that cannot be fetched is left out
    return files


def _report(msg: dict[str, Any]) -> None:
    try:
        write_all_fd(SOCK_FD, json.dumps(msg).encode())
        os.close(SOCK_FD)
    except OSError:
        pass  # the server stopped listening (client gone); the zygote's exit report still reaches it


_in_call = False
_interrupted = False


def _interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    if _in_call:  # a late SIGINT (after the call returned) must not break the session loop
        _interrupted = True
        raise KeyboardInterrupt


def _session_loop(namespace: dict[str, Any], limits: dict[str, Any]) -> NoReturn:
    """Serve calls until the server closes the socket; globals persist across calls."""
    global _in_call, _interrupted
    signal.signal(signal.SIGINT, _interrupt)
    while True:
        request = read_frame_fd(SOCK_FD, limits["request_bytes"])
        if request is None:
            os._exit(0)
        code, error, _interrupted = 0, None, False
        started = time.monotonic()
        try:
            _write_files(request.get("files") or {})
            _set_stdin(request.get("stdin"))
        except (OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        if error is None:
            _in_call = True
            try:
                code = _run_python(request["code"], namespace)
            finally:
                _in_call = False
        if os.getpid() != 1:  # a fork of the session's code: exit, never answer in the session's name
            _finish_python()
            os._exit(code)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S112
                continue
        files = _fetch(request.get("fetch_files") or [], limits["fetch_bytes"])
        reply = {"code": code, "interrupted": _interrupted, "files": files, "error": error,
                 "time": time.monotonic() - started}
        write_all_fd(SOCK_FD, encode_frame(reply))
