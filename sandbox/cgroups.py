"""Memory and process-count caps from cgroups (v1 or v2), one cgroup per zygote, one below it for runs.

pool.py gives every zygote (one worker slot, and the sessions' zygote) its own cgroup and puts the
zygote's launcher in it before it forks, so every process of that worker is inside: a multi-process fork
bomb hits `pids.max` where rlimits (per uid) would count otherwise. Below it, `run` holds a run's program
and everything it starts (program.py joins it through a cgroup.procs descriptor the server opened):
its `memory` limit is the run's memory budget, counting real memory of all of the run's processes and
its /tmp files, not address space. A worker runs one program at a time, so one `run` group per worker is
a per-run cgroup without a per-run cost.

The sessions' worker has no `run` group but one memory group per live session (`session.<n>`, made
when the session starts and removed when it has ended), whose limit is that session's budget.

Layout: <controller mount>/<the server's own cgroup>/agentrl-sandbox-<server pid>/<worker name>.<n>/{zygote,run}
(the zygote's processes live in `zygote`: cgroup v2 allows processes only in leaves; n counts the zygotes
the server started, so a replacement never shares the group of the one it replaces).
Where no usable hierarchy is writable (unprivileged server without delegation), `CgroupSet.create`
returns None with the reason and the sandbox relies on rlimits alone (README, "Isolation").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("sandbox.cgroups")
PREFIX = "agentrl-sandbox-"


def mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of the cgroup mounts visible to us."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            fstype, _source, options = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(options.split(","))))
    return found


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in the hierarchy holding `controller` (None: the v2 hierarchy)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            names = controllers.split(",") if controllers else []
            if (controller is None and not controllers) or controller in names:
                return path
    return "/"


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _remove_stale(base: str) -> None:
    """Remove groups left by servers that died without cleaning up (their pid is gone)."""
    if not os.path.isdir(base):
        return
    for entry in os.listdir(base):
        if entry.startswith(PREFIX) and entry[len(PREFIX):].isdigit():
            if not os.path.exists(f"/proc/{entry[len(PREFIX):]}"):
                _remove_group(os.path.join(base, entry))


def _remove_group(group: str) -> None:
    """A group and the groups below it, deepest first (each empty once its processes are gone)."""
    try:
        entries = os.listdir(group)
    except OSError:
        return
    for entry in entries:
        if os.path.isdir(os.path.join(group, entry)):
            _remove_group(os.path.join(group, entry))
    _rmdir_quiet(group)


def _rmdir_quiet(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError as e:
        log.debug("could not remove cgroup %s: %s", path, e)


@dataclass
class CgroupSet:
    version: str  # "v1" or "v2"
    groups: dict[str, str]  # controller ("memory", "pids"; "unified" on v2) -> our group directory

    @classmethod
    def create(cls) -> tuple[CgroupSet | None, str]:
        """Our group under each usable hierarchy, or (None, why not)."""
        name = f"{PREFIX}{os.getpid()}"
        found = mounts()
        v1 = {c: m for m, fstype, opts in found if fstype == "cgroup" for c in ("memory", "pids") if c in opts}
        try:
            if len(v1) == 2:
                groups = {}
                for controller, mount in v1.items():
                    base = mount + _own_path(controller)
                    _remove_stale(base)
                    groups[controller] = os.path.join(base, name)
                    os.makedirs(groups[controller], exist_ok=True)
                return cls("v1", groups), "cgroup v1 (memory, pids)"
            v2 = [m for m, fstype, _ in found if fstype == "cgroup2"]
            for mount in v2:
                base = mount + _own_path(None)
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    if not {"memory", "pids"} <= set(f.read().split()):
                        continue
                _remove_stale(base)
                _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
                group = os.path.join(base, name)
                os.makedirs(group, exist_ok=True)
                _write(os.path.join(group, "cgroup.subtree_control"), "+memory +pids")
                return cls("v2", {"unified": group}), "cgroup v2 (memory, pids)"
        except OSError as e:
            return None, f"cgroups unavailable ({e}); memory and process caps rely on rlimits"
        return None, "no cgroup hierarchy with memory and pids controllers; relying on rlimits"

    def make(self, worker: str, memory_bytes: int, pids: int, run_memory_bytes: int | None = None) -> None:
        """The worker's group (`memory_bytes`, `pids` for all of its processes) with its `zygote` leaf and,
        when `run_memory_bytes` is given, its `run` leaf with that memory limit."""
        leaves = ["zygote"] + (["run"] if run_memory_bytes is not None else [])
        for controller, group in self.groups.items():
            path = os.path.join(group, worker)
            os.makedirs(path, exist_ok=True)
            if self.version == "v2":
                _write(os.path.join(path, "cgroup.subtree_control"), "+memory +pids")
            for leaf in leaves:
                os.makedirs(os.path.join(path, leaf), exist_ok=True)
            if controller in ("memory", "unified"):
                self._limit_memory(path, memory_bytes)
                if run_memory_bytes is not None:
                    self._limit_memory(os.path.join(path, "run"), run_memory_bytes)
            if controller in ("pids", "unified"):
                _write(os.path.join(path, "pids.max"), str(pids))

    def _limit_memory(self, path: str, memory_bytes: int) -> None:
        """memory (and, where swap is accounted, memory+swap: no swapping around the limit) of one group."""
        if self.version == "v2":
            _write(os.path.join(path, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
            return
        # v1: memory+swap may never be below memory: lowering sets memory first, raising memory+swap first.
        limit = os.path.join(path, "memory.limit_in_bytes")
        memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
        order = [limit, memsw]
        if os.path.exists(memsw):
            with open(limit) as f:
                if memory_bytes > int(f.read()):
                    order.reverse()
        for file in order:
            if os.path.exists(file):
                _write(file, str(memory_bytes))

    def _memory_leaf(self, worker: str, leaf: str) -> str:
        """A leaf of the worker's group in the memory hierarchy (v1) or the unified one (v2)."""
        return os.path.join(self.groups.get("memory") or self.groups["unified"], worker, leaf)

    def _open_procs(self, group: str) -> int:
        """A write descriptor on `group`'s procs file: writing "0" moves the writer there. The kernel checks
        the opener's credentials (ours), so a program's process may use it unprivileged."""
        name = "tasks" if self.version == "v1" else "cgroup.procs"
        return os.open(os.path.join(group, name), os.O_WRONLY | os.O_CLOEXEC)

    def set_run_memory(self, worker: str, memory_bytes: int) -> None:
        """The memory limit of the worker's `run` group (the next run's budget)."""
        self._limit_memory(self._memory_leaf(worker, "run"), memory_bytes)

    def attach(self, worker: str, pid: int) -> None:
        """Put `pid` (a zygote's launcher, before it forks) in the worker's `zygote` leaf."""
        for group in self.groups.values():
            _write(os.path.join(group, worker, "zygote", "cgroup.procs"), str(pid))

    def open_run_procs(self, worker: str) -> int:
        """A write descriptor on the `run` group's procs file (`_open_procs`)."""
        return self._open_procs(self._memory_leaf(worker, "run"))

    def open_session(self, worker: str, leaf: str, memory_bytes: int) -> int:
        """A memory group of its own for one session (`leaf`, beside the worker's other leaves) with
        `memory_bytes` as its limit; returns a write descriptor on its procs file (`_open_procs`).
        Each session's memory is then counted, and reclaimed or OOM-killed, apart from the others' and
        from the zygote's and the forker's."""
        group = self._memory_leaf(worker, leaf)
        os.makedirs(group, exist_ok=True)
        try:
            self._limit_memory(group, memory_bytes)
            return self._open_procs(group)
        except OSError:
            _rmdir_quiet(group)
            raise

    def remove_session(self, worker: str, leaf: str) -> bool:
        """Remove a session's group; False while it still holds a process (the caller tries again later)."""
        try:
            os.rmdir(self._memory_leaf(worker, leaf))
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def oom_kills(self, worker: str, leaves: tuple[str, ...] = ("run", "zygote")) -> int:
        """How many times the kernel OOM-killed inside these groups of the worker (for /health)."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        total = 0
        for leaf in leaves:
            try:
                with open(os.path.join(self._memory_leaf(worker, leaf), name)) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            total += int(value)
            except OSError:
                continue
        return total

    def remove(self, worker: str) -> None:
        for group in self.groups.values():
            _remove_group(os.path.join(group, worker))

    def destroy(self) -> None:
        for group in self.groups.values():
            _remove_group(group)
