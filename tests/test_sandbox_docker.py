"""The Docker backend (sandbox/docker_backend.py).

The in-container driver and the container configuration are checked everywhere (the driver runs as
a plain subprocess here); the tests that need a Docker engine skip with the reason when none answers.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sandbox.docker_backend import DRIVER, container_config, driver_request
from sandbox.run import Job
from sandbox.settings import Settings
from sandbox.testing import ServerProcess


def engine_reachable() -> bool:
    try:
        import docker

        return bool(docker.from_env(timeout=3).ping())
    except Exception:  # noqa: BLE001 - no socket, no permission, no daemon: all mean no engine
        return False


needs_engine = pytest.mark.skipif(not engine_reachable(), reason="no Docker engine reachable")


def drive(job: Job, settings: Settings = Settings(max_output_bytes=1000)) -> dict:
    done = subprocess.run([sys.executable, "-c", DRIVER], input=driver_request(settings, job),
                          capture_output=True, timeout=60, cwd="/tmp")
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def test_driver_runs_files_stdin_and_truncates():
    job = Job(code="import sys\nprint(open('in/a.txt').read() + sys.stdin.read())\nopen('o.txt', 'w').write('r')\n"
                   "sys.stderr.write('e' * 5000)\nsys.exit(2)", language="python", timeout_s=10, memory_mb=256,
              stdin="-piped", files={"in/a.txt": base64.b64encode(b"file").decode()}, fetch_files=["o.txt", "no"])
    report = drive(job)
    assert (report["status"], report["code"], report["stdout"]) == ("Finished", 2, "file-piped\n")
    assert report["stderr"].startswith("e" * 1000) and "5000 bytes written" in report["stderr"]
    assert report["files"] == {"o.txt": base64.b64encode(b"r").decode()}


def test_driver_enforces_the_timeout_on_the_whole_process_group():
    report = drive(Job(code="sleep 30 & echo $!; sleep 30", language="bash", timeout_s=0.5, memory_mb=256))
    assert report["status"] == "TimeLimitExceeded" and report["code"] is None
    background = Path(f"/proc/{int(report['stdout'].split()[0])}/stat")  # killed too, not only the leader

    def running() -> bool:
        try:
            return background.read_text().split(")")[-1].split()[0] != "Z"
        except OSError:  # gone
            return False

    deadline = time.monotonic() + 10
    while running():
        assert time.monotonic() < deadline, "the run's background process outlived its timeout"
        time.sleep(0.01)  # a polling interval: the process table is read each time


def test_container_config_isolates():
    config = container_config(Settings(disk_mb=64, max_processes=16),
                              Job(code="1", language="python", timeout_s=5, memory_mb=300))
    assert config["network_mode"] == "none" and config["network_disabled"] and config["read_only"]
    assert config["cap_drop"] == ["ALL"] and config["security_opt"] == ["no-new-privileges"]
    assert config["user"] == "65534:65534" and config["pids_limit"] == 16
    assert config["mem_limit"] == config["memswap_limit"] == 300 << 20
    assert config["tmpfs"] == {"/tmp": "size=64m,mode=1777"} and "detach" not in config


@pytest.fixture(scope="module")
def docker_server() -> ServerProcess:
    with ServerProcess("--backend", "docker", "--workers", "2", "--disk-mb", "64") as server:
        yield server


@needs_engine
def test_docker_backend_runs_and_contains(docker_server):
    def run(code: str, **fields) -> dict:
        body = {"code": code, "language": "python", "run_timeout": 10, **fields}
        return httpx.post(docker_server.url + "/run_code", json=body, timeout=120).json()

    assert run("print(1+1)")["run_result"]["stdout"] == "2\n"
    net = run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n    print('open')\n"
              "except OSError:\n    print('no network')")
    assert net["run_result"]["stdout"] == "no network\n"
    assert "Read-only" in run("open('/usr/x', 'w')")["run_result"]["stderr"]
    assert run("while True: pass", run_timeout=1)["run_result"]["status"] == "TimeLimitExceeded"
    sessions = httpx.post(docker_server.url + "/sessions", json={})
    assert sessions.status_code == 400 and "namespace backend" in sessions.json()["detail"]
