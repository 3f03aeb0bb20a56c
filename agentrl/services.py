"""The tools' services for a run: given URLs, or started by the trainer (`auto`).

An auto service is `python -m sandbox serve` / `python -m retriever serve` on a free loopback port, its
output in `<run_dir>/logs/<name>.log`; `services.sandbox_replicas` sandboxes share a run's code calls
(tools.Replicas sends them round-robin). With `services.on_ray` each auto service runs in a Ray actor
instead (RayService), spread over the cluster's nodes and bound to its node's address, the
sandbox then behind a token the run generates. `start` waits until `/health` answers; a service that exits or
does not answer in time fails the run at once, naming the service and its log. At each step's start and,
during the step, every `services.watch_interval_s` (`watch`), the trainer calls `revive`: a service that
died is started again on the same port, so the tool clients' URLs stay valid. While it is down its tool calls fail, and those failures are observations the model sees (the
clients never raise), so the run goes on. `stop` ends them at exit.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentrl.config import ConfigError

if TYPE_CHECKING:
    from agentrl.run_config import ServicesConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the service's process before exec: SIGKILL it when the trainer dies, even by SIGKILL (Linux)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class ServiceProcess:
    """One auto service: `module` (sandbox | retriever) served with `args` on a free port of `host`
    (loopback by default), its output in `log_dir/<name>.log`."""

    def __init__(self, module: str, args: list[str], log_dir: Path, startup_timeout_s: float,
                 name: str | None = None, host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        self.module, self.args, self.host, self.env = module, args, host, env or {}
        self.port = free_port()
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_dir / f"{name or module}.log"
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", self.module, "serve", "--host", self.host, "--port", str(self.port),
                   *self.args]
        # Owner-only: a service's log holds what its clients sent (code, tokens in errors).
        fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # a log left by an older run keeps its mode otherwise
        with open(fd, "ab") as log:
            log.write(f"--- {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent, env=os.environ | self.env)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:  # readiness polling: the service answers /health once its workers are up
            if self.proc.poll() is not None:
                raise ConfigError(f"services: the {self.module} exited while starting (status "
                                  f"{self.proc.returncode}); its log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"services: the {self.module} did not answer {self.url}/health within "
                                  f"{self.startup_timeout_s:g} s; its log: {self.log_path}")
            time.sleep(0.2)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def revive(self) -> bool:
        """Start the service again if it died; True if it had to."""
        if self.alive:
            return False
        self.restarts += 1
        self.start()
        return True

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the service and anything it started
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


class Services:
    """The URLs of the services a task's tools need (`urls`: one per tool, or a list of a tool's replicas),
    starting the `auto` ones; `sandbox_token` is what the sandbox clients send (None: no token)."""

    def __init__(self, tools: list[str], config: ServicesConfig, log_dir: Path) -> None:
        self.urls: dict[str, str | list[str]] = {}
        self.managed: list[ServiceProcess] = []
        self.watch_interval_s = config.watch_interval_s
        self._reviving = threading.Lock()  # the watcher's thread and the step's start revive one at a time
        self.sandbox_token = config.sandbox_token
        make = RayService if config.on_ray else ServiceProcess
        wanted = {"python": ("sandbox", config.sandbox), "search": ("retriever", config.retriever)}
        for tool in tools:
            module, where = wanted[tool]
            if where != "auto":
                self.urls[tool] = where
                continue
            replicas, env = 1, {}
            if module == "sandbox":
                replicas = config.sandbox_replicas
                if config.on_ray and self.sandbox_token is None:  # off loopback: only the run may run code there
                    self.sandbox_token = secrets.token_urlsafe(24)
                if self.sandbox_token:  # in the environment, not on a command line others can list
                    env = {"AGENTRL_SANDBOX_TOKEN": self.sandbox_token}
                args = list(config.sandbox_args)
            else:
                if not config.retriever_index:
                    raise ConfigError("services.retriever is auto: set services.retriever_index (an index dir "
                                      "built by `agentrl retriever build`) or give services.retriever a URL")
                args = ["--index", config.retriever_index]
            started = [make(module, args, log_dir, config.startup_timeout_s,
                            name=module if replicas == 1 else f"{module}-{i}", env=env) for i in range(replicas)]
            self.managed += started
            self.urls[tool] = started[0].url if replicas == 1 else [s.url for s in started]

    def start(self) -> None:
        try:
            for service in self.managed:
                service.start()
        except BaseException:
            self.stop()
            raise

    def revive(self) -> dict[str, float]:
        """Restart any auto service that died; metrics `services/<module>_restarts` (cumulative, over its replicas)."""
        restarts: dict[str, float] = {}
        with self._reviving:
            for service in self.managed:
                service.revive()
                key = f"services/{service.module}_restarts"
                restarts[key] = restarts.get(key, 0.0) + service.restarts
        return restarts

    async def watch(self) -> None:
        """Revive dead auto services every `watch_interval_s` until cancelled (nothing to watch: returns), so
        one that dies mid-step is back within the step; its calls fail as observations meanwhile."""
        while self.managed and self.watch_interval_s > 0:
            await asyncio.sleep(self.watch_interval_s)
            await asyncio.to_thread(self.revive)

    def stop(self) -> None:
        for service in self.managed:
            service.stop()

    def __enter__(self) -> Services:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ServiceActor:
    """An auto service (ServiceProcess) started by an actor on its node, bound to the node's
    address so that the driver and the other nodes reach it."""

    def __init__(self, module: str, args: list[str], log_dir: str, startup_timeout_s: float, name: str,
                 env: dict[str, str]) -> None:
        import ray

        self.service = ServiceProcess(module, args, Path(log_dir), startup_timeout_s, name=name,
                                      host=ray.util.get_node_ip_address(), env=env)

    def url(self) -> str:
        return self.service.url

    def start(self) -> None:
        self.service.start()

    def revive(self) -> tuple[bool, int]:
        return self.service.revive(), self.service.restarts

    def stop(self) -> None:
        self.service.stop()


class RayService:
    """ServiceProcess's interface over a _ServiceActor; the service actors of a run are spread
    over the cluster's nodes (Ray's SPREAD strategy)."""

    def __init__(self, module: str, args: list[str], log_dir: Path, startup_timeout_s: float,
                 name: str | None = None, env: dict[str, str] | None = None) -> None:
        import ray

        self.module = module
        self.restarts = 0
        actor = ray.remote(_ServiceActor).options(num_cpus=1, scheduling_strategy="SPREAD")
        self.actor = actor.remote(module, args, str(log_dir), startup_timeout_s, name or module, env or {})
        try:  # Ray waits for a free CPU forever: past the startup timeout, say why
            self.url: str = ray.get(self.actor.url.remote(), timeout=startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.actor)
            raise ConfigError(f"services.on_ray: the {name or module} actor (a CPU) was not placed within "
                              f"{startup_timeout_s:g} s; the Ray cluster has no CPU free for it") from None

    def start(self) -> None:
        import ray

        ray.get(self.actor.start.remote())

    def revive(self) -> bool:
        import ray

        revived, self.restarts = ray.get(self.actor.revive.remote())
        return revived

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote())
        finally:
            ray.kill(self.actor)
