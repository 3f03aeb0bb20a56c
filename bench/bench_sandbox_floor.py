"""The floor under a sandbox request's CPU: what the process and namespace steps of one isolated run cost.

A sandbox run needs, whatever the code around it: a process for the program forked from an image that has
imported numpy and sympy (so that a run does not pay for those imports), fresh mount, IPC and network
namespaces, a PID namespace whose PID 1 (the supervisor) the program cannot reach, and every one of those
processes' exits. This bench times each step alone, in one process, in the ways the sandbox can arrange
them (`sandbox/zygote.py`, `sandbox/forker.py` and `sandbox/supervisor.py`):

- a lean supervisor: a Python without numpy forks a child into a new PID namespace (as the zygote forks
  its supervisors), which makes new mount, IPC and network namespaces and exits;
- the program's process forked from the preloaded image (numpy and sympy imported, GC frozen, its heap on
  2 MB pages as the forker keeps it), exiting at once;
- the chain before the lean supervisor: the preloaded image forks the supervisor into a new PID namespace,
  which makes the same namespaces and forks the program from itself.

Each row leaves out what the processes do once they exist (mounts, the request, the program's code), so
a design costs at least its rows: the lean supervisor with the program forked from the preloaded image
(today's sandbox), the first two; the design before it, the third. CPU is the parent's and the reaped children's user + system time per iteration; machine busy is the whole
machine's (/proc/stat), which also counts the kernel workers that tear network namespaces down afterwards:
run it on an otherwise idle machine. Sum the steps of a design
and add the HTTP server's and the program's own work to see how many requests a second two cores can
serve at best. Linux only; not root, it runs in a user namespace of its own.

    .venv/bin/python bench/bench_sandbox_floor.py [--iterations 300]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import libc  # noqa: E402
from sandbox.testing import machine_busy  # noqa: E402


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(child: Callable[[], None], iterations: int, pid_namespace: bool = False) -> tuple[float, float, float]:
    """Fork `iterations` children that run `child` and exit, each into a new PID namespace of its own
    (as its PID 1) with `pid_namespace`; (wall ms, CPU ms, machine's busy ms) per fork, exit and reap."""
    own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    wall, cpu, busy = time.perf_counter(), _cpu(), machine_busy()
    for _ in range(iterations):
        if pid_namespace:
            libc.unshare(libc.CLONE_NEWPID)  # only the next child goes there
        pid = os.fork()
        if pid_namespace and pid != 0:
            libc.setns(own, libc.CLONE_NEWPID)
        if pid == 0:
            try:
                child()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"a measured child failed (status {status})")
    os.close(own)
    time.sleep(0.5)  # let the kernel's deferred teardown of the last namespaces finish inside the window
    return ((time.perf_counter() - wall - 0.5) * 1e3 / iterations, (_cpu() - cpu) * 1e3 / iterations,
            (machine_busy() - busy) * 1e3 / iterations)


def _nothing() -> None:
    pass


def _namespaces() -> None:
    libc.unshare(libc.CLONE_NEWNS | libc.CLONE_NEWIPC | libc.CLONE_NEWNET)


def _fork_and_reap() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _namespaces_then_fork() -> None:
    _namespaces()
    _fork_and_reap()


def _own_user_namespace() -> None:
    """Root of a user namespace of our own (unprivileged callers), so that unshare is allowed."""
    if os.geteuid() == 0:
        return
    uid, gid = os.getuid(), os.getgid()
    libc.unshare(libc.CLONE_NEWUSER)
    libc.map_self_to_root(uid, gid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    _own_user_namespace()
    rows: list[tuple[str, float, float, float]] = []

    def row(label: str, child: Callable[[], None], pid_namespace: bool = False) -> None:
        measure(child, max(1, args.iterations // 10), pid_namespace)  # warm-up
        rows.append((label, *measure(child, args.iterations, pid_namespace)))

    row("lean: fork + exit", _nothing)
    row("lean supervisor: fork into a new PID namespace, new mount + IPC + network namespaces, exit",
        _namespaces, pid_namespace=True)
    import numpy  # noqa: F401
    import sympy  # noqa: F401

    gc.collect()
    gc.freeze()
    huge = libc.collapse_to_huge_pages()
    rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    row("program: fork of the preloaded image + exit", _nothing)
    row("before: preloaded fork into a new PID namespace, new namespaces, fork again + exit",
        _namespaces_then_fork, pid_namespace=True)
    print(f"preloaded image: numpy + sympy, {rss / 2**20:.0f} MiB resident, {huge / 2**20:.0f} MiB on 2 MB pages; "
          f"{args.iterations} iterations a row")
    width = max(len(r[0]) for r in rows)
    print(f"{'step':<{width}}  {'wall ms':>8}  {'CPU ms':>7}  {'machine busy ms':>15}")
    for label, wall, cpu, busy in rows:
        print(f"{label:<{width}}  {wall:>8.2f}  {cpu:>7.2f}  {busy:>15.2f}")
    lean = rows[1][3] + rows[2][3]
    print(f"floor of a request's CPU (machine busy): lean supervisor + program {lean:.2f} ms, the chain before it "
          f"{rows[3][3]:.2f} ms ({rows[3][3] / lean:.2f}x)")


if __name__ == "__main__":
    main()
