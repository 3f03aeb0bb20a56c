"""Execution backends behind the HTTP layer (server.py): one narrow interface, two implementations.

`NamespaceBackend` (the default) isolates with this host's kernel: a pool of pre-started zygotes
(pool.py, worker.py, zygote.py, supervisor.py, program.py) confined by namespaces, rlimits, a seccomp
filter and cgroups (cgroups.py), plus the
sessions' zygote (sessions.py). `DockerBackend` (docker_backend.py) runs each program in a fresh
container through a Docker engine and has no sessions. `make_backend` picks one from the settings.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from sandbox.cgroups import CgroupSet
from sandbox.pool import WorkerPool
from sandbox.run import Job, Outcome
from sandbox.sessions import SessionManager
from sandbox.settings import Settings
from sandbox.worker import CAP_SYS_RESOURCE, become_subreaper, claim_uid_block, holds_capability


class Backend(Protocol):
    name: str
    sessions: SessionManager | None

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def run(self, job: Job) -> Outcome: ...

    def status(self) -> dict[str, Any]: ...


class NamespaceBackend:
    name = "namespace"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        become_subreaper()
        self.root = os.geteuid() == 0 and not settings.single_uid
        # As root, runs get host uids of a block no other sandbox service holds (kept while we live).
        self.uid_base, self._uid_lock = claim_uid_block(settings.uid_base) if self.root else (settings.uid_base, -1)
        self.cgroups, self.cgroup_note = CgroupSet.create()
        self.pool = WorkerPool(settings, self.cgroups, self.uid_base)
        self.sessions: SessionManager | None = (
            SessionManager(settings, self.cgroups, self.uid_base) if settings.max_sessions > 0 else None)

    async def start(self) -> None:
        await self.pool.start()
        if self.sessions is not None:
            await self.sessions.start()

    async def stop(self) -> None:
        if self.sessions is not None:
            await self.sessions.stop()
        await self.pool.stop()
        if self.cgroups is not None:
            self.cgroups.destroy()
        if self._uid_lock >= 0:
            os.close(self._uid_lock)
            self._uid_lock = -1

    async def run(self, job: Job) -> Outcome:
        return await self.pool.run(job)

    def status(self) -> dict[str, Any]:
        return {
            **self.pool.status(),
            **(self.sessions.status() if self.sessions else {"sessions": 0, "max_sessions": 0, "session_oom_kills": 0}),
            "isolation": {
                "namespaces": ["user", "pid", "mount", "network", "ipc", "uts"],
                "uids": f"host uids {self.uid_base}-{self.uid_base + 65535}, held by this service alone"
                        if self.root else
                        "single-uid fallback: runs keep the server's host uid, with no capabilities",
                "host_uid_base": self.uid_base if self.root else None,
                "cgroups": self.cgroup_note,
                "memory": "real memory of a run's (a session's) processes and /tmp files (cgroup)" if self.cgroups else
                          "address space per process (RLIMIT_AS)",
                "seccomp": "keyring, kernel-log, inotify/fanotify and io_uring calls denied (ENOSYS); "
                           "sockets only AF_UNIX, AF_INET, AF_INET6, route netlink (else EAFNOSUPPORT)",
                "oom_priority": "1000, a floor no program can lower (the server holds CAP_SYS_RESOURCE)"
                                if holds_capability(CAP_SYS_RESOURCE) else
                                "1000 at start; a program may lower it to the server's own (the server lacks "
                                "CAP_SYS_RESOURCE)",
            },
        }


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "docker":
        from sandbox.docker_backend import DockerBackend

        return DockerBackend(settings)
    if settings.backend != "namespace":
        raise ValueError(f"unknown backend {settings.backend!r}; expected 'namespace' or 'docker'")
    return NamespaceBackend(settings)
