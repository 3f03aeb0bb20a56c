"""The run's program process, forked by the program forker (forker.py) into the run's namespaces.

It is forked ahead of the run (a session's, when the session starts), already under no_new_privs and the
seccomp filter it inherits from the forker (forker.confine says what it denies), and prepares what does not
depend on the request (`prepare`): it leaves the process group and session it was born in, joins the run's
memory cgroup, closes every descriptor it inherited, drops to the run's unprivileged uid (or, in the
single-uid fallback, drops every capability) with its static rlimits, reseeds the random generators and
builds a fresh `__main__`. Then it waits. When its supervisor (supervisor.py)
hands it the run (`start`), it puts the run's stdout/stderr at fds 1/2, reads the request, writes the input
files and the program file, sets the run's memory and CPU limits, tells the supervisor it starts, closes its
last line to it and becomes the program: Python runs in this already-warm interpreter from
`/tmp/work/main.py` (so `__file__` is defined), bash is exec'd on `/tmp/work/main.sh`. Its exit status,
which its parent the forker passes to the supervisor, is what the supervisor reports; it has no way to send
anything else.

Sessions (sessions.py) keep the process alive and loop over length-prefixed calls on the session's socket,
keeping one `__main__`.
"""

from __future__ import annotations

import atexit
import base64
import builtins
import ctypes
import errno
import fcntl
import io
import json
import math
import os
import resource
import signal
import sys
import threading
import time
import types
from typing import Any, NoReturn

from sandbox import libc
from sandbox.wire import encode_frame, read_frame_fd, write_all_fd

WORKDIR = "/tmp/work"
SESSION_FD = 3  # a session's socket, at a fixed number once stdio is in place
SETUP_FAILED = 125
MB = 1024 * 1024
_mapped = 0  # bytes the interpreter had mapped when prepared; RLIMIT_AS (no cgroup) adds the budget on top
# Bound now: a program may rebind os._exit / os.kill (SandboxFusion's anti-hack header sets them to None),
# and this process must still end with the program's status.
exit_now, _kill = os._exit, os.kill


class RequestError(Exception):
    """The request cannot be set up (its files do not fit the run's /tmp): the client's fault, a 4xx."""


def prepare(static: dict[str, Any], uid: int, keep: int, cgroup_fd: int | None) -> dict[str, Any]:
    """Everything that does not depend on the request or on the run's mounts (which the supervisor makes
    meanwhile); returns the fresh `__main__` namespace. `keep`: the one descriptor left open (the line to
    the supervisor); the cgroup's is used, then closed."""
    # A process group and session of its own: groups span PID namespaces, and kill(0) would otherwise reach
    # every process of the server's group that its uid may signal (the next run's prepared program).
    os.setsid()
    if cgroup_fd is not None:  # the run's (session's) memory cgroup: every process of the program counts there
        os.write(cgroup_fd, b"0")
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already
    # Under memory pressure the kernel kills programs first, never the service. Raising needs no
    # privilege; the floor that keeps the program from lowering it again is the server's (worker.py).
    fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
    os.write(fd, b"1000")
    os.close(fd)
    limits = static["limits"]
    if static["map_self"]:  # one uid mapped: stay uid 0 inside, but with no capabilities at all
        libc.drop_all_capabilities()
    else:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    # setresuid made us non-dumpable, which hands /proc/self (fd, environ, ...) to the namespace's root:
    # the program could not even list its own descriptors. Its uid is its alone, so this exposes nothing.
    libc.prctl(libc.PR_SET_DUMPABLE, 1)
    for kind, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, limits["nproc"]),
        (resource.RLIMIT_NOFILE, limits["nofile"]),
        (resource.RLIMIT_FSIZE, limits["fsize_mb"] * MB),
        (resource.RLIMIT_MEMLOCK, 0),
    ):
        resource.setrlimit(kind, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-size writes fail with EFBIG instead of killing
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the supervisor ignores it; Python does not
    _reseed_numpy()
    compile("pass", "<string>", "exec")  # fault in the compiler's pages now, not on the request's time
    global _mapped
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    _mapped = int(os.read(fd, 64).split()[0]) * resource.getpagesize()  # the interpreter's own mappings
    os.close(fd)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main  # pickle and multiprocessing look the program's classes up here
    return main.__dict__


def start(request: dict[str, Any], lang: str, limits: dict[str, Any], fds: list[int]) -> str:
    """The run has arrived: stdio in place, files written, limits set. Returns the program file's path.
    `fds`: the request's stdin (memfd or None -> /dev/null) is written here; [stdout, stderr]."""
    place_fds(fds, (1, 2))
    _set_stdin(request.get("stdin"))
    write_files(request.get("files") or {})
    path = _program_path(request.get("files") or {}, "py" if lang == "python" else "sh")
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(request["code"])
    set_limits(limits)
    return path


def set_limits(limits: dict[str, Any]) -> None:
    """The limits that come with the request: CPU time, and address space where no cgroup counts memory."""
    if not limits["cgroup_memory"]:  # address space is the only memory limit: keep thread arenas few
        libc.limit_malloc_arenas(2)
        resource.setrlimit(resource.RLIMIT_AS, (_mapped + 64 * MB + limits["memory_mb"] * MB,) * 2)
    # soft == hard: the hard limit's SIGKILL always lands, whatever the program does with SIGXCPU.
    resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(limits["cpu_s"]),) * 2)


def place_fds(fds: list[int], targets: tuple[int, ...]) -> None:
    """Move each of `fds` to its target number (moved out of the way first, so none overwrites another)."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)  # inheritable, as stdio is
        os.close(fd)


def _program_path(files: dict[str, str | None], suffix: str) -> str:
    """`main.py` / `main.sh` in the working dir, or `main_<n>` where the request brought such a file."""
    taken = {os.path.normpath(p) for p in files}
    name, n = f"main.{suffix}", 0
    while name in taken:
        n += 1
        name = f"main_{n}.{suffix}"
    return os.path.join(WORKDIR, name)


def write_files(files: dict[str, str | None]) -> None:
    """Write the request's files; a write the run's /tmp cannot hold is the request's fault."""
    for rel, content in files.items():
        if content is None:
            continue
        path = os.path.normpath(os.path.join(WORKDIR, rel))
        if not path.startswith(WORKDIR + "/"):
            raise RequestError(f"files: {rel!r} leaves the working directory")
        try:
            makedirs(os.path.dirname(path))
            with open(path, "wb") as f:
                f.write(base64.b64decode(content))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENAMETOOLONG):
                raise RequestError(f"files: writing {rel[:80]!r} failed: {os.strerror(e.errno)}") from None
            raise


def makedirs(path: str, mode: int = 0o777) -> None:
    """os.makedirs without its recursion, which fails on paths nested a thousand levels deep."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory, mode)


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


def run_python(path: str, args: list[str], namespace: dict[str, Any]) -> NoReturn:
    """Run the program file as `python path args...` would, then exit like the interpreter."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    namespace["__file__"] = path
    with open(path, encoding="utf-8", errors="surrogatepass") as f:
        code = f.read()
    status, interrupted = _execute(code, path, namespace)
    finish_python()
    if interrupted:  # an uncaught KeyboardInterrupt: the interpreter ends by SIGINT, so do we
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _kill(os.getpid(), signal.SIGINT)
    exit_now(status)


def exec_bash(path: str, args: list[str]) -> NoReturn:
    """Become `bash path args...` with the signal dispositions a shell started by a shell would have."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.execve("/bin/bash", ["bash", path, *args], dict(os.environ))


def _execute(code: str, filename: str, namespace: dict[str, Any]) -> tuple[int, bool]:
    """(exit status, whether it ended by an uncaught KeyboardInterrupt)."""
    try:
        exec(compile(code, filename, "exec"), namespace)
    except SystemExit as e:
        return _exit_status(e), False
    except BaseException as e:  # noqa: BLE001 - printed like the interpreter does, exit status 1
        tb = _program_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1, isinstance(e, KeyboardInterrupt)
    return 0, False


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


def finish_python() -> None:
    """What the interpreter does at exit: join non-daemon threads, run atexit, flush stdio."""
    steps = (threading._shutdown, atexit._run_exitfuncs, sys.stdout.flush, sys.stderr.flush)  # type: ignore[attr-defined]
    for step in steps:
        try:
            step()
        except BaseException:  # noqa: BLE001, S112 - the program's own mess; its output is already out
            continue


_numpy_state: int | None = None  # address of numpy's global MT19937 state, when it could be verified


def locate_numpy_state() -> None:
    """Called by the forker after its imports. numpy.random.seed() in each run would touch, hence copy,
    many pages of the forker's memory; writing fresh entropy straight into the generator's state
    (`key[624]`, then `pos`) touches one. Used only if a test write reads back exactly."""
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
    """Forked children would all draw the forker's numpy sequence: give each fresh entropy."""
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


def fetch_session_files(paths: list[str], budget: int) -> dict[str, str]:
    """A session call's fetch_files (inside the working dir; missing or oversized ones are left out)."""
    files: dict[str, str] = {}
    for rel in paths:
        path = os.path.normpath(os.path.join(WORKDIR, rel))
        try:
            if path.startswith(WORKDIR + "/") and os.path.isfile(path) and os.path.getsize(path) <= budget:
                with open(path, "rb") as f:
                    data = f.read(budget + 1)
                budget -= len(data)
                files[rel] = base64.b64encode(data).decode()
        except OSError:
            continue
    return files


_in_call = False
_interrupted = False


def _interrupt(signum: int, frame: Any) -> None:
    global _interrupted
    if _in_call:  # a late SIGINT (after the call returned) must not break the session loop
        _interrupted = True
        raise KeyboardInterrupt


def session_loop(namespace: dict[str, Any], limits: dict[str, Any]) -> NoReturn:
    """Serve calls until the server closes the socket; globals persist across calls. The replies come
    from this process, which runs the session's code: they are only as trustworthy as that code."""
    global _in_call, _interrupted
    signal.signal(signal.SIGINT, _interrupt)
    me = os.getpid()
    while True:
        request = read_frame_fd(SESSION_FD, limits["request_bytes"])
        if request is None:
            exit_now(0)
        code, error, refused, _interrupted = 0, None, None, False
        started = time.monotonic()
        try:
            write_files(request.get("files") or {})
            _set_stdin(request.get("stdin"))
        except RequestError as e:  # the files do not fit what the session's /tmp has left: the client's 4xx
            refused = str(e)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        if error is None and refused is None:
            _in_call = True
            try:
                code, _ = _execute(request["code"], "<string>", namespace)
            finally:
                _in_call = False
        if os.getpid() != me:  # a fork of the session's code: exit, never answer in the session's name
            finish_python()
            exit_now(code)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S112
                continue
        files = fetch_session_files(request.get("fetch_files") or [], limits["fetch_bytes"])
        reply = {"code": code, "interrupted": _interrupted, "files": files, "error": error, "refused": refused,
                 "time": time.monotonic() - started}
        write_all_fd(SESSION_FD, encode_frame(reply))


def load_request(fd: int, limit: int) -> dict[str, Any]:
    """The request JSON from the memfd the supervisor filled."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise ValueError(f"request of {size} bytes exceeds the {limit}-byte limit")
    data = os.pread(fd, size, 0)
    os.close(fd)
    return json.loads(data)
