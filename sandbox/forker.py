"""The program forker: the one process of a worker that holds the preloaded interpreter, and forks every
run's program process from it, straight into that run's namespaces.

The zygote (zygote.py) forks it once, before importing anything heavy itself, so that the zygote and the
supervisors it forks per run stay lean (a fork's cost grows with the memory of the process forked). The
forker imports the preload list (numpy, sympy, ...), freezes the GC, collapses its memory into huge pages,
reports what it could not import, then serves:

* the zygote hands it one end of a socketpair per supervisor it forks (the supervisor keeps the other);
* a supervisor asks on it for its program's process, passing its PID, mount, IPC and network namespaces
  and the program's end of a channel to itself (`fork`). The forker enters that PID namespace for its next
  child only and forks; the child joins the other three namespaces while it is still privileged, then
  prepares as program.py says and waits for its supervisor's word (`program_main`);
* when a program's process exits, the forker reads its status without reaping it and sends it to that
  process's supervisor, the only one who may learn it: the program is the forker's child, not the
  supervisor's, so the supervisor cannot wait for it. The process is reaped once its supervisor's channel
  closes: the supervisor is exiting, and the kernel holds its exit until every process of its PID
  namespace is reaped, so no pid of the run is reused while the run's answer is being made.

The program cannot reach the forker: the forker is outside the run's PID namespace, under another uid
(in the single-uid fallback, with capabilities the program lacks), and none of its descriptors are left
to the program. The filter keeps the program from making further children of the forker
(clone(CLONE_PARENT)) and from tracing (a tracer would hold a dead program's status from the forker), and
the forker never blocks on a child: its exit status is all the forker ever takes from it.
"""

from __future__ import annotations

import errno
import gc
import importlib
import os
import selectors
import socket
from dataclasses import dataclass, field
from typing import Any, NoReturn

from sandbox import libc, program
from sandbox.program import SETUP_FAILED, WORKDIR
from sandbox.wire import recv_msg, send_msg

# Keyrings are kept per uid and per user namespace, outside any process, so a key added by one run
# would be there for the next; the kernel log outlives runs too. inotify and fanotify on the shared
# read-only binds (the venv, /usr) would tell a run which files other runs and host processes open.
# io_uring submits work the filter never sees (its IORING_OP_SOCKET would bypass the socket rule below).
# ptrace: a tracer holds a dead tracee's exit from its parent, the forker, which serves every run of the
# worker. clone3's flags are out of the filter's reach (libc falls back to clone, whose flags are not).
# userfaultfd: a program needs none, and it widens the races kernel exploits rely on.
# Programs get ENOSYS, as on a kernel built without them.
DENIED_SYSCALLS = ("add_key", "request_key", "keyctl", "syslog", "inotify_init", "inotify_init1",
                   "fanotify_init", "io_uring_setup", "io_uring_enter", "io_uring_register", "ptrace", "clone3",
                   "userfaultfd")
F_NOTIFY = 1026  # fcntl.F_NOTIFY where Python exposes it
# clone(CLONE_PARENT) would make the forker the parent of a program's child: a zombie of a run that only the
# forker could reap, holding the run's supervisor in its exit (EPERM, as for an init process). fcntl's
# F_NOTIFY (dnotify) watches a directory as inotify does (EINVAL, as on a kernel without it).
ARGUMENT_RULES = {"clone": (0, "any_bits", libc.CLONE_PARENT, errno.EPERM),
                  "fcntl": (1, "equals", F_NOTIFY, errno.EINVAL)}
# The socket families a program may create (others: EAFNOSUPPORT). Unix and IP sockets live in the run's
# own network namespace (abstract Unix names included; IP on loopback only); AF_VSOCK's port space
# is the VM's, shared with the hypervisor, host agents and every other run. Netlink only as
# NETLINK_ROUTE (protocol 0): getaddrinfo and if_nameindex ask it about the run's own interfaces (lo);
# the other netlink protocols (audit, uevents, sock_diag, ...) are kernel surface no program needs.
ALLOWED_SOCKETS: dict[int, tuple[int, ...] | None] = {
    socket.AF_UNIX: None, socket.AF_INET: None, socket.AF_INET6: None, socket.AF_NETLINK: (0,)}
# The namespaces a program's process joins after its fork (it was forked into the PID one), by their names
# under /proc/<pid>/ns: the supervisor sends them in this order, after its PID namespace.
JOINED = (("mnt", libc.CLONE_NEWNS), ("ipc", libc.CLONE_NEWIPC), ("net", libc.CLONE_NEWNET))
PENDING_RETRY_S = 0.05


def preload(modules: list[str], warmup: list[str]) -> list[str]:
    """Import `modules` and run the `warmup` snippets; returns what failed (the runs then pay for it)."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:  # serve without it; programs importing it pay the import
            missing.append(f"{name}: {e}")
    for snippet in warmup:
        try:
            exec(snippet, {})  # first calls that pull in lazily imported submodules (sympy's printers)
        except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation, never a requirement
            missing.append(f"warm-up failed: {e}")
    program.locate_numpy_state()
    gc.collect()
    gc.freeze()  # forked children then never touch (copy) the pages of these objects for GC
    libc.collapse_to_huge_pages()  # fork and reap by 2 MB page-table entries, not 4 KB ones
    return missing


def confine() -> None:
    """no_new_privs and the programs' seccomp filter (`DENIED_SYSCALLS`, `ALLOWED_SOCKETS`, `ARGUMENT_RULES`),
    set here once: every program's process is our child and inherits both, irrevocably. We need none of
    what the filter denies."""
    libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
    libc.deny_syscalls(DENIED_SYSCALLS, errno.ENOSYS, ALLOWED_SOCKETS, ARGUMENT_RULES)


def main(ctl: socket.socket, config: dict[str, Any]) -> NoReturn:
    """The forker's entry point, right after the zygote's fork; `ctl` is its line to the zygote."""
    try:
        missing = preload(config["preload"], config.get("warmup", []))
        confine()
        send_msg(ctl, {"op": "ready", "missing": missing})
        _Forker(ctl, config["child"]).serve()
    except BaseException as e:  # noqa: BLE001 - the zygote sees our exit (or this message) and fails
        try:
            send_msg(ctl, {"op": "failed", "message": f"{type(e).__name__}: {e}"})
        finally:
            os._exit(1)


@dataclass
class _Run:
    """A supervisor's channel and the program processes forked for it (pid -> pidfd, None once exited)."""
    channel: socket.socket
    programs: dict[int, int | None] = field(default_factory=dict)


class _Forker:
    def __init__(self, ctl: socket.socket, static: dict[str, Any]) -> None:
        self.ctl = ctl
        self.static = static
        self.sel = selectors.DefaultSelector()
        self.sel.register(ctl, selectors.EVENT_READ, ("control", None))
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.pending: dict[int, _Run] = {}  # exited programs not yet waitable by us (see `_status`)

    def serve(self) -> NoReturn:
        while True:
            for pid, run in list(self.pending.items()):
                self._status(run, pid)
            for key, _ in self.sel.select(PENDING_RETRY_S if self.pending else None):
                kind, target = key.data
                if kind == "control":
                    self._on_control()
                elif kind == "run":
                    self._on_request(target)
                else:
                    self._on_exit(*target)

    def _on_control(self) -> None:
        msg, fds = recv_msg(self.ctl)
        if msg is None:  # the zygote is gone (and with it, as PID 1 of our namespace, so are we)
            os._exit(0)
        run = _Run(socket.socket(fileno=fds[0]))
        self.sel.register(run.channel, selectors.EVENT_READ, ("run", run))

    def _on_request(self, run: _Run) -> None:
        msg, fds = recv_msg(run.channel)
        if msg is None:  # the supervisor has exited: reap what it left (its namespace kills the rest)
            self.sel.unregister(run.channel)
            run.channel.close()
            for pid, pidfd in list(run.programs.items()):
                if pidfd is None:
                    os.waitpid(pid, 0)
                    del run.programs[pid]
            return
        try:
            pid = self._fork(msg["uid"], fds, msg["own_group"])
        except OSError as e:  # the program's channel is closed unused: the supervisor sees that
            os.write(2, f"sandbox: forking a program failed: {e}\n".encode())
            return
        finally:
            for fd in fds:
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        run.programs[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", (run, pid)))

    def _fork(self, uid: int, fds: list[int], own_group: bool) -> int:
        """fds: the program's channel, then the run's PID, mount, IPC and network namespaces, then, with
        `own_group` (a session), its own memory group's procs file; a run's program joins the worker's
        `run` group, whose descriptor came with our config."""
        channel, pidns, *joined = fds
        cgroup_fd = joined.pop() if own_group else self.static.get("cgroup_fd")
        if len(joined) != len(JOINED):
            raise OSError(f"expected a channel and 4 namespaces{' and a cgroup' * own_group}, got {len(fds)} "
                          "descriptors")
        libc.setns(pidns, libc.CLONE_NEWPID)  # only our next child goes there; we stay where we are
        try:
            pid = os.fork()
        except OSError:
            libc.setns(self.own_pidns, libc.CLONE_NEWPID)
            raise
        if pid == 0:
            try:  # never return into the forker's loop, whatever the program did to the interpreter
                for fd, (_, kind) in zip(joined, JOINED, strict=True):
                    libc.setns(fd, kind)
                program_main(self.static, uid, channel, cgroup_fd)
            except BaseException as e:  # noqa: BLE001
                os.write(2, f"sandbox: preparing the program failed: {type(e).__name__}: {e}\n".encode())
            finally:
                program.exit_now(SETUP_FAILED)
        libc.setns(self.own_pidns, libc.CLONE_NEWPID)
        return pid

    def _on_exit(self, run: _Run, pid: int) -> None:
        pidfd = run.programs[pid]
        assert pidfd is not None
        self.sel.unregister(pidfd)
        os.close(pidfd)
        self._status(run, pid)

    def _status(self, run: _Run, pid: int) -> None:
        """Pass on the exited program's status, or keep it pending: never block on a child (a tracer, were
        one allowed, would keep its dead tracee from us for as long as it lived)."""
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is None:
            self.pending[pid] = run
            return
        self.pending.pop(pid, None)
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if run.channel.fileno() < 0:  # its supervisor is gone: nobody to tell
            os.waitpid(pid, 0)
            del run.programs[pid]
            return
        run.programs[pid] = None
        try:
            send_msg(run.channel, {"op": "exit", "code": code})
        except OSError:
            pass  # the supervisor is exiting; its channel's end (seen next) reaps this process


def program_main(static: dict[str, Any], uid: int, channel: int, cgroup_fd: int | None) -> NoReturn:
    """In the program's process: prepare (program.prepare), wait until the supervisor has mounted the
    run's /tmp, then for the run or session, and become the program."""
    chan = socket.socket(fileno=channel)
    namespace = program.prepare(static, uid, channel, cgroup_fd)
    mounted, _ = recv_msg(chan)
    if mounted is None:
        program.exit_now(0)
    os.chdir(WORKDIR)
    send_msg(chan, {"op": "ready", "pid": os.getpid()})
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
