"""Execution backends behind the HTTP layer (server.py): one narrow interface, two implementations.

`NamespaceBackend` (the default) isolates with this host's kernel: a pool of pre-started zygotes
(pool.py, zygote.py, child.py) confined by namespaces, rlimits and cgroups (cgroups.py), plus the
sessions' zygote (sessions.py). `DockerBackend` (docker_backend.py) runs each program in a fresh
container through a Docker engine and has no sessions. `make_backend` picks one from the settings.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from sandbox.cgroups import CgroupSet
from sandbox.pool import WorkerPool, become_subreaper
from sandbox.run import Job, Outcome
from sandbox.sessions import SessionManager
from sandbox.settings import Settings


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
        self.cgroups, self.cgroup_note = CgroupSet.create()
        self.pool = WorkerPool(settings, self.cgroups)
        self.sessions: SessionManager | None = (
            SessionManager(settings, self.cgroups) if settings.max_sessions > 0 else None)

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

    async def run(self, job: Job) -> Outcome:
        return await self.pool.run(job)

    def status(self) -> dict[str, Any]:
        root = os.geteuid() == 0 and not self.settings.single_uid
        return {
            **self.pool.status(),
            **(self.sessions.status() if self.sessions else {"sessions": 0, "max_sessions": 0}),
            "isolation": {
                "namespaces": ["user", "pid", "mount", "network", "ipc", "uts"],
                "uids": "a host uid range unused by anything else" if root else
                        "single-uid fallback: runs keep the server's host uid, with no capabilities",
                "cgroups": self.cgroup_note,
            },
        }


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "docker":
        from sandbox.docker_backend import DockerBackend

        return DockerBackend(settings)
    if settings.backend != "namespace":
        raise ValueError(f"unknown backend {settings.backend!r}; expected 'namespace' or 'docker'")
    return NamespaceBackend(settings)
