"""The run's auto services (services.py): several sandbox replicas share the code calls round-robin, each
with its own log, over real HTTP on loopback."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.run_config import ServicesConfig
from agentrl.services import Services
from agentrl.tools import Replicas, build_tools
from agentrl.types import ToolCall

SIX_BY_SEVEN = ToolCall("python", {"code": "print(6 * 7)"})


async def _calls(tool, k: int) -> list:
    return [await tool.call(SIX_BY_SEVEN) for _ in range(k)]


@pytest.mark.slow
def test_sandbox_replicas_share_the_calls_round_robin(tmp_path):
    config = ServicesConfig(sandbox_replicas=2, sandbox_args=["--workers", "1"])
    with Services(["python"], config, tmp_path) as services:
        urls = services.urls["python"]
        assert isinstance(urls, list) and len(set(urls)) == 2
        tool = build_tools(services.urls)["python"]
        assert isinstance(tool, Replicas)

        async def run() -> tuple[list, list]:
            both = await _calls(tool, 2)
            services.managed[0].stop()  # replica 0 down: every other call now fails, the rest still run
            after = await _calls(tool, 4)
            await tool.aclose()
            return both, after

        both, after = asyncio.run(run())
    assert [(r.error, r.text.strip()) for r in both] == [(None, "42"), (None, "42")]
    assert [r.error == "connection" for r in after] == [True, False, True, False]
    assert [r.text.strip() for r in after[1::2]] == ["42", "42"]
    assert {p.name for p in tmp_path.glob("*.log")} == {"sandbox-0.log", "sandbox-1.log"}
    # owner-only: a service's log holds what its clients sent
    assert {p.stat().st_mode & 0o777 for p in tmp_path.glob("*.log")} == {0o600}


def test_a_service_killed_mid_step_is_back_without_waiting_for_the_next_step(tmp_path):
    import os
    import signal
    import time

    config = ServicesConfig(sandbox_args=["--workers", "1"], watch_interval_s=0.2)
    with Services(["python"], config, tmp_path) as services:
        tool = build_tools(services.urls)["python"]
        service = services.managed[0]

        async def run() -> tuple[list, int]:
            watcher = asyncio.create_task(services.watch())
            try:
                os.killpg(service.proc.pid, signal.SIGKILL)  # as a crash would, mid-step
                service.proc.wait()
                deadline = time.monotonic() + 120  # a bound, not a timing: the watcher starts it again
                while service.restarts == 0 or not service.alive:
                    assert time.monotonic() < deadline, "the watcher never started the sandbox again"
                    await asyncio.sleep(0.05)
                return await _calls(tool, 1), service.restarts
            finally:
                watcher.cancel()
                await tool.aclose()

        [result], restarts = asyncio.run(run())
    assert restarts == 1 and result.error is None and result.text.strip() == "42"  # on the same URL
