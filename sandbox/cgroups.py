"""Memory and process-count caps from cgroups (v1 or v2), one cgroup per zygote.

pool.py gives every zygote (one worker slot, and the sessions' zygote) its own cgroup and puts the
zygote's launcher in it before it forks, so every run of that worker is inside: a multi-process memory
or fork bomb hits `memory` / `pids` limits even where rlimits (per process) would not add up. A worker
runs one program at a time, so a per-worker cgroup is a per-run cgroup without a per-run cost.

Layout: <controller mount>/<the server's own cgroup>/agentrl-sandbox-<server pid>/<worker name>.
Where no usable hierarchy is writable (unprivileged server without delegation), `CgroupSet.create`
returns None with the reason and the sandbox relies on rlimits alone (README, "Isolation").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger("sandbox.cgroups")
PREFIX = "agentrl-sandbox-"


def _mounts() -> list[tuple[str, str, set[str]]]:
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
    """A server's group and its workers' groups below it (empty once their processes are gone)."""
    for child in os.listdir(group):
        if os.path.isdir(os.path.join(group, child)):
            _rmdir_quiet(os.path.join(group, child))
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
        mounts = _mounts()
        v1 = {c: m for m, fstype, opts in mounts if fstype == "cgroup" for c in ("memory", "pids") if c in opts}
        try:
            if len(v1) == 2:
                groups = {}
                for controller, mount in v1.items():
                    base = mount + _own_path(controller)
                    _remove_stale(base)
                    groups[controller] = os.path.join(base, name)
                    os.makedirs(groups[controller], exist_ok=True)
                return cls("v1", groups), "cgroup v1 (memory, pids)"
            v2 = [m for m, fstype, _ in mounts if fstype == "cgroup2"]
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

    def make(self, worker: str, memory_bytes: int, pids: int) -> None:
        for controller, group in self.groups.items():
            path = os.path.join(group, worker)
            os.makedirs(path, exist_ok=True)
            if self.version == "v2":
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), "0")
                _write(os.path.join(path, "pids.max"), str(pids))
            elif controller == "memory":
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
                memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                if os.path.exists(memsw):  # no swapping around the limit where swap is accounted
                    _write(memsw, str(memory_bytes))
            else:
                _write(os.path.join(path, "pids.max"), str(pids))

    def set_memory(self, worker: str, memory_bytes: int) -> None:
        group = self.groups.get("memory") or self.groups["unified"]
        if self.version == "v2":  # memory.swap.max stays 0
            _write(os.path.join(group, worker, "memory.max"), str(memory_bytes))
            return
        # v1: memory+swap moves with the memory limit (no swapping around it), and may never be below it:
        # lowering sets memory first, raising sets memory+swap first.
        limit = os.path.join(group, worker, "memory.limit_in_bytes")
        memsw = os.path.join(group, worker, "memory.memsw.limit_in_bytes")
        order = [limit, memsw]
        if os.path.exists(memsw):
            with open(limit) as f:
                if memory_bytes > int(f.read()):
                    order.reverse()
        for path in order:
            if os.path.exists(path):
                _write(path, str(memory_bytes))

    def attach(self, worker: str, pid: int) -> None:
        for group in self.groups.values():
            _write(os.path.join(group, worker, "cgroup.procs"), str(pid))

    def oom_kills(self, worker: str) -> int:
        """How many times the kernel OOM-killed inside this worker's cgroup (for /health)."""
        group = self.groups.get("memory") or self.groups.get("unified")
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            with open(os.path.join(group or "", worker, name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def remove(self, worker: str) -> None:
        for group in self.groups.values():
            _rmdir_quiet(os.path.join(group, worker))

    def destroy(self) -> None:
        for group in self.groups.values():
            _remove_group(group)
