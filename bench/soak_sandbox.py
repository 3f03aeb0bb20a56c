"""Soak of the sandbox service under a trainer's load: many tiny programs, hundreds of clients at once.

`python -m sandbox serve` (sandbox.testing.ServerProcess, full isolation, default queue) takes N requests of
`print(1+1)` from C concurrent keep-alive clients (bench_sandbox.Client). Every answer must be a 200 whose
stdout is "2\\n": anything else (a refusal, a lost or wrong answer, a broken connection) is a failure.
Shown: failures, latency percentiles as the clients saw them, throughput, and how long requests waited
for a worker as the server measured it (/health `queue_wait_s`, sampled while the soak runs and at its
end), then processes left behind.

    .venv/bin/python bench/soak_sandbox.py [--requests 10000] [--concurrency 256] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_sandbox import TRIVIAL, Client, load_average, request, table  # noqa: E402

from sandbox.testing import ServerProcess  # noqa: E402


async def soak(port: int, concurrency: int, n: int) -> tuple[list[float], list[str], float]:
    """Latencies of the requests that succeeded, what went wrong with the others, and the wall time."""
    body, remaining = request(TRIVIAL), n
    latencies: list[float] = []
    failures: list[str] = []

    async def client() -> None:
        nonlocal remaining
        connection = Client(port)
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            try:
                status, payload = await connection.post(body)
                answer = json.loads(payload)
                stdout = answer.get("run_result", {}).get("stdout") if status == 200 else None
                if stdout == "2\n":
                    latencies.append(time.perf_counter() - started)
                else:
                    failures.append(f"{status}: {payload[:200]!r}")
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                connection = Client(port)
                failures.append(f"{type(e).__name__}: {e}")

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, failures, time.perf_counter() - started


async def sample_queue(url: str, stop: asyncio.Event, seen: list[float]) -> None:
    """The longest current wait for a worker, every half second while the soak runs."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            health = (await client.get(url + "/health")).json()
            seen.append(health["queue_wait_s"]["longest_now"])
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass


async def run(server: ServerProcess, concurrency: int, n: int) -> tuple[list[float], list[str], float, list[float]]:
    stop, seen = asyncio.Event(), []
    sampler = asyncio.create_task(sample_queue(server.url, stop, seen))
    try:
        latencies, failures, wall = await soak(server.port, concurrency, n)
    finally:
        stop.set()
        await sampler
    return latencies, failures, wall, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--workers", type=int, default=None, help="sandbox workers (default: the server's)")
    args = parser.parse_args()
    print(f"load average before: {load_average()} on {os.cpu_count()} CPUs")
    extra = ["--workers", str(args.workers)] if args.workers else []
    with ServerProcess(*extra, "--max-sessions", "0") as server:
        latencies, failures, wall, sampled = asyncio.run(run(server, args.concurrency, args.requests))
        health = httpx.get(server.url + "/health", timeout=10).json()
        leaked = server.leftovers(timeout=30)
    print(f"load average after: {load_average()}")
    wait = health["queue_wait_s"]
    cuts = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [0.0] * 99
    table([
        ("requests x concurrency", f"{args.requests} x {args.concurrency}", f"{health['workers']} workers"),
        ("failures", str(len(failures)), f"{len(leaked)} processes left"),
        ("latency p50 / p99 / max", f"{cuts[49]:.2f} / {cuts[98]:.2f} / {max(latencies, default=0):.2f} s", ""),
        ("throughput", f"{len(latencies) / wall:.0f} req/s", f"{wall:.0f} s"),
        ("queue wait (server), longest", f"{wait['max_since_start']:.2f} s", f"limit {wait['limit']:g} s"),
        ("queue wait, p50 / p99 of last", f"{wait['p50']:.2f} / {wait['p99']:.2f} s", f"{wait['samples']} requests"),
        ("queue wait, sampled max", f"{max(sampled, default=0):.2f} s", f"{len(sampled)} samples"),
    ], title=f"sandbox soak ({os.cpu_count()}-core host)", columns=("metric", "value", "context"))
    for failure in failures[:10]:
        print("failed:", failure)
    if leaked:
        print("left behind:", *leaked, sep="\n  ")


if __name__ == "__main__":
    main()
