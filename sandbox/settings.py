"""Service settings: every limit and size the sandbox enforces, in one place.

cli.py builds a `Settings` from flags; server.py, pool.py, sessions.py and docker_backend.py read it.
Per-request values (`run_timeout`, `memory_limit_MB`) are clamped to the maxima here (`clamp_*`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

MB = 1024 * 1024
# What the interpreter itself needs of a run's budget before the program's first line: a run's own
# memory starts near zero (the preloaded interpreter's pages are shared with its worker); print(1), numpy
# and sympy programs were measured to start within 2 MB, and 1 MB kills the interpreter while it sets the
# run up. 8 MB leaves margin for that measurement.
INTERPRETER_MB = 8
# The smallest memory budget a run or session may ask for: the interpreter's need and room for a small
# program's own allocations (a traceback, a list of a few thousand numbers).
MIN_MEMORY_MB = 16
# How many times a request's bytes sit in the run's memory while it is set up: the copy the supervisor
# hands over (a memfd), the program's read of it, and the parsed strings (stdin, base64 files), which stay
# for the whole run. Measured: 10-40 MB of stdin needed 3.0-3.1x its size in budget, base64 files 3.7x
# their encoded size (decoded files land in /tmp, which the budget counts as well).
REQUEST_COPIES = 3


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    token: str | None = None  # bearer token; None: no authentication (loopback default)
    backend: str = "namespace"  # "namespace" (this host's kernel) or "docker"
    docker_image: str = "python:3.11-slim"

    workers: int = field(default_factory=lambda: max(2, 2 * (os.cpu_count() or 1)))  # concurrent runs
    max_queue: int = 256  # runs waiting for a worker beyond which the service answers 503
    queue_timeout_s: float = 60.0

    max_code_bytes: int = 1 * MB  # larger `code` -> 413
    max_request_bytes: int = 64 * MB  # whole body (code + base64 files) -> 413
    max_output_bytes: int = 1 * MB  # per stream; the rest is discarded behind a marker
    max_fetch_bytes: int = 16 * MB  # total of fetched files per run

    default_run_timeout_s: float = 10.0
    max_run_timeout_s: float = 120.0
    default_memory_mb: int = 1024  # memory_limit_MB <= 0 means this
    max_memory_mb: int = 4096
    max_processes: int = 64  # RLIMIT_NPROC (per run uid) and the cgroup's pids.max
    max_open_files: int = 256
    max_file_size_mb: int = 64  # RLIMIT_FSIZE
    disk_mb: int = 256  # tmpfs /tmp (holding the working dir) per run

    single_uid: bool = False  # force the unprivileged-host fallback (one uid, no capabilities) as root
    uid_base: int = 2_000_000_000  # first host uid block (65536 uids) tried for the namespace's uids (root only)
    run_uid: int = 1000  # inside uid of worker i's runs is run_uid + i
    session_uid: int = 20000  # inside uid of the k-th session is session_uid + k % 40000
    preload: tuple[str, ...] = (
        "math", "numpy", "numpy.random", "numpy.linalg", "numpy.fft", "sympy", "fractions", "itertools",
        "collections", "decimal", "statistics", "cmath", "random", "re", "json",
    )
    extra_binds: tuple[str, ...] = ()

    max_sessions: int = 32  # live sessions; creating one more -> 429
    session_idle_s: float = 600.0  # a session unused this long is closed
    max_session_idle_s: float = 3600.0  # the longest idle_timeout a session may ask for
    session_cpu_s: float = 600.0  # RLIMIT_CPU over a session's whole life
    session_memory_mb: int = 1024  # a session's budget when its creator gives none
    sessions_memory_mb: int = 8192  # the budgets of all live sessions together (cgroup cap on them all)

    def clamp_timeout(self, requested: float | None) -> float:
        if requested is None or requested <= 0:
            return self.default_run_timeout_s
        return min(float(requested), self.max_run_timeout_s)

    def clamp_idle(self, requested: float | None) -> float:
        if requested is None or requested <= 0:
            return self.session_idle_s
        return min(float(requested), self.max_session_idle_s)

    def setup_memory_bytes(self, request_bytes: int, file_bytes: int) -> int:
        """Memory a run (or session call) needs before its code starts: `request_bytes` of request as the
        program receives it, `file_bytes` of files in /tmp pages, and the interpreter; at least the floor."""
        return max(MIN_MEMORY_MB * MB, REQUEST_COPIES * request_bytes + file_bytes + INTERPRETER_MB * MB)

    def clamp_memory(self, requested_mb: int | None) -> int:
        if requested_mb is None or requested_mb <= 0:
            return self.default_memory_mb
        return min(int(requested_mb), self.max_memory_mb)

    @property
    def max_report_bytes(self) -> int:
        """Largest report a run or session call may send back: fetched files base64-encoded, plus room."""
        return self.max_fetch_bytes * 2 + (1 << 20)
