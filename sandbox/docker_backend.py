"""The Docker backend: each run in a fresh, throw-away container, for hosts with a Docker engine.

Selected with `--backend docker` (backend.make_backend). Each run creates a container from
`docker_image` with no network, a read-only root, a size-limited tmpfs on /tmp, uid 65534, no
capabilities, no-new-privileges, and memory / pids / nofile / fsize / cpu limits; starts it with `DRIVER`
(below) as its command, writes the request to its stdin, waits up to the run's timeout (then kills it),
reads the driver's JSON report from its logs and removes it. The driver, inside the container, writes the
input files, runs the program with the request's stdin and timeout, caps its output and fetches files.
Containers start in about a second, so this backend is for isolation, not latency; it has no sessions.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from typing import Any

from sandbox.pool import Overloaded
from sandbox.run import Job, Outcome
from sandbox.settings import Settings

# Runs inside the container as `python -c DRIVER`: request JSON on stdin, one report JSON on stdout.
DRIVER = r"""
import base64, json, os, subprocess, sys, time
req = json.loads(sys.stdin.buffer.read())
work = '/tmp/work'
os.makedirs(work, exist_ok=True)
os.chdir(work)
def inside(rel):
    path = os.path.normpath(os.path.join(work, rel))
    if not path.startswith(work + '/'):
        raise ValueError(rel)
    return path
for rel, content in (req.get('files') or {}).items():
    if content is not None:
        path = inside(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, 'wb') as f:
            f.write(base64.b64decode(content))
argv = ['python', '-c', req['code'], *req['args']] if req['language'] == 'python' else \
       ['bash', '-c', req['code'], 'bash', *req['args']]
cap = req['max_output']
out, err = open('/tmp/.out', 'w+b'), open('/tmp/.err', 'w+b')
start = time.monotonic()
proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True)
try:
    proc.communicate((req.get('stdin') or '').encode(), timeout=req['timeout'])
    status, code = 'Finished', proc.returncode
except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)
    proc.wait()
    status, code = 'TimeLimitExceeded', None
elapsed = time.monotonic() - start
def text(f):
    size = f.seek(0, 2)
    f.seek(0)
    data = f.read(cap).decode('utf-8', 'replace')
    if size > cap:
        data += '\n[... output truncated: %d bytes written, the first %d kept ...]\n' % (size, cap)
    return data
files, budget = {}, req['fetch_bytes']
for rel in req.get('fetch_files') or []:
    try:
        path = inside(rel)
        if os.path.isfile(path) and os.path.getsize(path) <= budget:
            data = open(path, 'rb').read()
            budget -= len(data)
            files[rel] = base64.b64encode(data).decode()
    except (OSError, ValueError):
        pass
print(json.dumps({'status': status, 'code': code, 'time': elapsed, 'stdout': text(out),
                  'stderr': text(err), 'files': files}))
"""
STARTUP_MARGIN_S = 30.0  # pulling layers and starting a container, beyond the run's own timeout


def container_config(settings: Settings, job: Job) -> dict[str, Any]:
    """Keyword arguments for `client.containers.create` (a pure function, tested without an engine)."""
    from docker.types import Ulimit

    mb = 1024 * 1024
    return {
        "image": settings.docker_image,
        "command": ["python", "-c", DRIVER],
        "stdin_open": True,
        "network_mode": "none",
        "network_disabled": True,
        "read_only": True,
        "tmpfs": {"/tmp": f"size={settings.disk_mb}m,mode=1777"},
        "user": "65534:65534",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "mem_limit": job.memory_mb * mb,
        "memswap_limit": job.memory_mb * mb,
        "pids_limit": settings.max_processes,
        "ulimits": [Ulimit(name="nofile", soft=settings.max_open_files, hard=settings.max_open_files),
                    Ulimit(name="fsize", soft=settings.max_file_size_mb * mb, hard=settings.max_file_size_mb * mb),
                    Ulimit(name="cpu", soft=int(job.timeout_s) + 2, hard=int(job.timeout_s) + 2)],
        "environment": {"HOME": "/tmp/work", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                        "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
        "working_dir": "/tmp",
        "labels": {"agentrl.sandbox": "run"},
        # Not detached + stdin_open gives StdinOnce: half-closing our attach socket ends the driver's stdin.
    }


def driver_request(settings: Settings, job: Job) -> bytes:
    return json.dumps({"code": job.code, "language": job.language, "stdin": job.stdin, "files": job.files,
                       "fetch_files": job.fetch_files, "args": job.args, "timeout": job.timeout_s,
                       "max_output": settings.max_output_bytes, "fetch_bytes": settings.max_fetch_bytes}).encode()


class DockerBackend:
    name = "docker"
    sessions = None

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.client: Any = None
        self.slots = asyncio.Semaphore(settings.workers)
        self.waiting = 0

    async def start(self) -> None:
        import docker

        loop = asyncio.get_running_loop()
        try:
            self.client = docker.from_env()
            await loop.run_in_executor(None, self.client.ping)
        except Exception as e:  # noqa: BLE001 - any failure here means: no usable engine
            raise RuntimeError(f"no Docker engine reachable ({e}); use --backend namespace") from e
        try:
            await loop.run_in_executor(None, self.client.images.get, self.settings.docker_image)
        except docker.errors.ImageNotFound:
            await loop.run_in_executor(None, self.client.images.pull, self.settings.docker_image)

    async def stop(self) -> None:
        if self.client is not None:
            self.client.close()

    async def run(self, job: Job) -> Outcome:
        if self.waiting >= self.settings.max_queue:
            raise Overloaded(f"{self.settings.max_queue} runs are already waiting for a container slot")
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), self.settings.queue_timeout_s)
        except TimeoutError:
            raise Overloaded("no container slot became free in time") from None
        finally:
            self.waiting -= 1
        holder: dict[str, Any] = {}
        try:
            run = asyncio.get_running_loop().run_in_executor(None, self._run_blocking, job, holder)
            return await asyncio.shield(run)
        except asyncio.CancelledError:  # client gone: kill the container now (off the event loop)
            if "container" in holder:
                remove = functools.partial(holder["container"].remove, force=True)
                asyncio.get_running_loop().run_in_executor(None, remove)
            raise
        finally:
            self.slots.release()

    def _run_blocking(self, job: Job, holder: dict[str, Any]) -> Outcome:
        container = self.client.containers.create(**container_config(self.settings, job))
        holder["container"] = container
        try:
            attached = container.attach_socket(params={"stdin": 1, "stream": 1})
            container.start()
            raw = attached._sock  # docker-py's SocketIO wraps the raw socket we must half-close
            raw.sendall(driver_request(self.settings, job))
            raw.shutdown(socket.SHUT_WR)
            try:
                container.wait(timeout=job.timeout_s + STARTUP_MARGIN_S)
            except Exception:  # noqa: BLE001 - requests' timeout: the driver itself is stuck
                container.kill()
                return Outcome("TimeLimitExceeded", job.timeout_s, message="the container did not finish")
            logs = container.logs(stdout=True, stderr=False).decode(errors="replace").strip().splitlines()
            report = json.loads(logs[-1]) if logs else {}
            if "status" not in report:
                err = container.logs(stdout=False, stderr=True).decode(errors="replace")[-2000:]
                return Outcome("Error", message=f"the container's driver failed: {err}")
            return Outcome(report["status"], report["time"], report["code"], report["stdout"], report["stderr"],
                           files=report["files"])
        finally:
            container.remove(force=True)
