"""Helpers to run a real sandbox server in a subprocess and to look for processes it left behind.

Used by tests/test_sandbox*.py and bench/bench_sandbox*.py: `ServerProcess` starts
`python -m sandbox serve` on a free loopback port and waits for /health by polling; `leftovers` lists
processes running under the sandbox's uids (runs and sessions) and the service's process count, so a test
can wait until every run's processes are gone; `sandbox_uid_processes` lists them at once; `nested_pids`
names a process's role by its pids in the nested PID namespaces; `machine_busy` is the whole machine's CPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from types import TracebackType

import httpx

from sandbox.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    children = {int(p) for p in f.read().split()}
                stack.extend(children - found)
                found |= children
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def descriptors(pid: int) -> list[tuple[str, str]]:
    """(fd, what it points to) of each descriptor a process holds, those closed meanwhile left out; [] for
    a process that has exited."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            out.append((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            continue
    return out


def nested_pids(pid: int) -> list[int] | None:
    """A process's pid in each PID namespace it is in, outermost first (NSpid), or None once it is gone: a
    worker's zygote is [pid, 1] and its forker [pid, 2], a run's supervisor [pid, n, 1] and program [pid, n, 2]."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next([int(p) for p in line.split()[1:]] for line in f if line.startswith("NSpid:"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def machine_busy() -> float:
    """Seconds of CPU the whole machine has spent busy (/proc/stat): includes the kernel's own workers, which
    tear a network namespace down after its last process exits, charged to no process."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int, int, str, str] | None:
    """(uid, parent pid, start time, name, state) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None
    return (int(status["Uid"].split()[0]), int(status["PPid"]), started, status["Name"].strip(),
            status["State"].strip())


def sandbox_uid_processes(uid_base: int = Settings().uid_base) -> list[str]:
    """Processes a run or session started and left: under a sandbox uid (inside uid >= 1000), either the
    child of another such process, or a second child of a run's supervisor (PID 1 of the run: a child of
    a zygote, both at the namespace's uid 0, `uid_base` outside). Not listed: each supervisor's first
    child, the program's process (prepared for the next run, or a live session's)."""
    table = {int(e): info for e in os.listdir("/proc") if e.isdigit() and (info := _stat(e)) is not None}

    def run_uid(uid: int) -> bool:
        return uid_base + 1000 <= uid < uid_base + 65536

    found, first_child = [], {}
    for pid, (uid, ppid, _started, name, state) in sorted(table.items(), key=lambda item: item[1][2]):
        if not run_uid(uid):
            continue
        parent = table.get(ppid)
        grandparent = table.get(parent[1]) if parent else None
        is_supervisor = parent is not None and grandparent is not None and parent[0] == grandparent[0] == uid_base
        if is_supervisor and first_child.setdefault(ppid, pid) == pid:
            continue
        if is_supervisor or (parent is not None and run_uid(parent[0])):
            found.append(f"pid {pid} uid {uid - uid_base} {name} {state}")
    return found


class ServerProcess:
    """`with ServerProcess("--workers", "2") as server: httpx.post(server.url + "/run_code", ...)`."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, token: str | None = None,
                 startup_timeout: float = 120.0, python: str = sys.executable) -> None:
        self.python = python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.args = [*args, *(["--token", token] if token else [])]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.baseline = 0

    def run_code(self, code: str, language: str = "python", run_timeout: float = 5, **fields: object,
                 ) -> httpx.Response:
        """POST /run_code (with this server's token, if any)."""
        body = {"code": code, "language": language, "run_timeout": run_timeout, **fields}
        return httpx.post(self.url + "/run_code", json=body, headers=self.headers, timeout=120)

    @property
    def cgroup_memory(self) -> bool:
        """Whether the server limits a run's real memory with a cgroup (else its address space)."""
        return "cgroup" in httpx.get(self.url + "/health", timeout=10).json()["isolation"]["memory"]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def __enter__(self) -> ServerProcess:
        command = [self.python, "-m", "sandbox", "serve", "--port", str(self.port), *self.args]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"sandbox-{self.port}.log"), "w+b")
        self.proc = subprocess.Popen(command, cwd=root, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_http(self.url + "/health", self.proc, self.startup_timeout)
        except RuntimeError as e:
            tail = self.log_tail()
            self.__exit__(None, None, None)
            raise RuntimeError(f"{e}\n{tail}") from None
        isolation = httpx.get(self.url + "/health", timeout=10).json().get("isolation", {})
        self.uid_base = isolation.get("host_uid_base") or Settings().uid_base
        self.baseline = self.settled_process_count()
        return self

    @staticmethod
    def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
        """Poll `url` until it answers 200 (readiness polling); fail if `proc` exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited during startup (status {proc.returncode})")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready within {timeout} s")

    def settled_process_count(self, timeout: float = 10.0) -> int:
        """The service's process count once it stops changing (spare children being re-forked)."""
        assert self.proc is not None
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            count = len(descendants(self.proc.pid))
            if count != last:
                last, stable_since = count, time.monotonic()
            elif time.monotonic() - stable_since > 0.3:
                break
            time.sleep(0.05)
        return last

    def leftovers(self, timeout: float = 15.0) -> list[str]:
        """Wait until every worker is idle again (its zygote reaped the last run), no process started by
        a run remains and the process tree is back to its idle size; what is left after `timeout` is
        returned (empty: clean)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            health = httpx.get(self.url + "/health", timeout=10).json()
            busy = health.get("alive", 0) - health.get("idle", 0)
            stray = sandbox_uid_processes(self.uid_base)
            extra = len(descendants(self.proc.pid)) - self.baseline
            if not stray and extra <= 0 and busy <= 0:
                return []
            if time.monotonic() > deadline:
                return stray + [f"{extra} more processes under the service than when idle"] * (extra > 0) + [
                    f"{busy} workers still busy"] * (busy > 0)
            time.sleep(0.05)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        clean = False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                clean = self.proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if clean and exc_type is None:  # keep the log of a server that failed, for the post-mortem
            os.unlink(self.log.name)
