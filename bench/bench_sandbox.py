"""Benchmark of the sandbox service against the naive baseline, side by side in one run.

Ours: `python -m sandbox serve` with full isolation (sandbox.testing.ServerProcess). Baseline: the same
HTTP stack (FastAPI + uvicorn, same /run_code schema) answering each request with a fresh
`subprocess.run([sys.executable, "-c", code])`, same time limit, no isolation (this file, `--baseline`).
Measured: latency p50/p99 of `print(1+1)` and of a numpy + sympy snippet (sequential requests);
throughput at concurrency 1, 8 and 32. The load generator is a small keep-alive HTTP/1.1 client (`Client`)
so that it takes little of the CPU the two servers are measured on. The soak (many requests at a
trainer's concurrency, failures and queue waits) is bench/soak_sandbox.py.

`--cpu-split` measures instead where the CPU of a request goes at concurrency 8 (our server alone): each
process role's CPU per request, from /proc (a process's own time, and its reaped children's: the zygote's
children are the runs' supervisors, the forker's the programs' processes), against the machine's busy time.

    .venv/bin/python bench/bench_sandbox.py [--workers N] [--cpu-split]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastapi import Request  # noqa: E402 - module level: FastAPI resolves the annotation by name

from sandbox.testing import ServerProcess, descendants, free_port, machine_busy, nested_pids  # noqa: E402

TRIVIAL = "print(1+1)"
NUMERIC = ("import numpy as np, sympy as sp\nx = sp.Symbol('x')\n"
           "print(np.linalg.solve(np.eye(3) * 2, np.ones(3)).sum(), sp.solve(x**2 - 5*x + 6, x))")


def baseline_app():  # the naive server, run in its own process with --baseline PORT
    from fastapi import FastAPI

    app = FastAPI()

    def execute(code: str, timeout: float) -> dict:
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout)
            result = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout.decode(),
                      "stderr": done.stderr.decode()}
        except subprocess.TimeoutExpired:
            result = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        result["execution_time"] = time.monotonic() - started
        ok = result["status"] == "Finished" and result["return_code"] == 0
        return {"status": "Success" if ok else "Failed", "message": "", "run_result": result, "files": {}}

    @app.post("/run_code")
    async def run_code(request: Request) -> dict:
        body = await request.json()
        return await asyncio.to_thread(execute, body["code"], float(body.get("run_timeout", 10)))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    return app


class Client:
    """Minimal HTTP/1.1 keep-alive client: one connection per concurrent worker."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = (f"POST /run_code HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        assert self.reader is not None
        status_line = await self.reader.readline()
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and "close" in value.lower():
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            self.writer.close()
            self.writer = None
        return int(status_line.split()[1]), payload


def request(code: str) -> bytes:
    return json.dumps({"code": code, "language": "python", "run_timeout": 10}).encode()


async def latency(port: int, code: str, n: int) -> tuple[float, float]:
    client, body, samples = Client(port), request(code), []
    for _ in range(n):
        started = time.perf_counter()
        status, payload = await client.post(body)
        samples.append(time.perf_counter() - started)
        assert status == 200 and json.loads(payload)["status"] == "Success", payload[:300]
    return statistics.median(samples) * 1e3, statistics.quantiles(samples, n=100, method="inclusive")[98] * 1e3


async def load(port: int, concurrency: int, n: int, expect: str = "2\n") -> tuple[float, int]:
    """Requests per second over `n` requests with `concurrency` in flight, and how many failed."""
    body, failures, remaining = request(TRIVIAL), 0, n

    async def worker() -> None:
        nonlocal failures, remaining
        client = Client(port)
        while remaining > 0:
            remaining -= 1
            try:
                status, payload = await client.post(body)
                ok = status == 200 and json.loads(payload)["run_result"]["stdout"] == expect
            except (OSError, ValueError, asyncio.IncompleteReadError):
                client, ok = Client(port), False
            failures += not ok

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - started), failures


COLUMNS = ("metric", "ours (isolated)", "baseline (no isolation)", "ours vs baseline")


def table(rows: list[tuple[str, ...]], title: str = "", columns: tuple[str, ...] = COLUMNS) -> None:
    title = title or f"sandbox vs naive subprocess baseline ({os.cpu_count()}-core host)"
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for col in columns:
            t.add_column(col, justify="left" if col == "metric" else "right")
        for row in rows:
            t.add_row(*row)
        Console(width=120).print(t)
    except ImportError:
        for row in rows:
            print(" | ".join(f"{c:>24}" for c in row))


async def measure(ours: int, theirs: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each metric on ours, then at once on the baseline, so both see the same background load. Latencies
    take the same number of samples on both sides (p99 interpolated alike); throughput gives the baseline
    4x fewer requests (each one costs a cold interpreter), and a failed request is an error, not a rate."""
    results: tuple[dict[str, float], dict[str, float]] = ({}, {})
    for port, scale in ((ours, 1), (theirs, 4)):
        await load(port, 4, 32 // scale)  # warm up connections and workers
    for key, code, n in (("trivial", TRIVIAL, 400), ("numeric", NUMERIC, 200)):
        for out, port in zip(results, (ours, theirs), strict=True):
            out[f"p50_{key}"], out[f"p99_{key}"] = await latency(port, code, n)
    for c in (1, 8, 32):
        for out, port, scale in zip(results, (ours, theirs), (1, 4), strict=True):
            out[f"thr_{c}"], failed = await load(port, c, 1200 // scale)
            if failed:
                raise RuntimeError(f"{failed} requests failed at concurrency {c} on port {port}: no rate to report")
    return results


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _ticks(pid: int) -> tuple[int, int]:
    """A process's own CPU and that of its reaped children, in clock ticks (utime+stime, cutime+cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _roles(server_pid: int) -> dict[str, list[int]]:
    """The long-lived processes by role: zygotes (a launcher's child, PID 1 of the worker's namespace) and
    forkers (the zygote's first child, PID 2 there)."""
    roles: dict[str, list[int]] = {"zygote": [], "forker": []}
    for pid in descendants(server_pid):
        nspid = nested_pids(pid)
        if nspid is not None and len(nspid) == 2:
            roles["zygote" if nspid[1] == 1 else "forker"].append(pid)
    return roles


def cpu_split(server: ServerProcess, n: int = 1500) -> list[tuple[str, str]]:
    """CPU ms per request of each role over `n` requests of print(1+1) at concurrency 8."""
    asyncio.run(load(server.port, 8, 100))  # warm up
    roles = _roles(server.proc.pid)
    watched = [server.proc.pid, *roles["zygote"], *roles["forker"]]
    before, busy, me = {pid: _ticks(pid) for pid in watched}, machine_busy(), os.times()
    asyncio.run(load(server.port, 8, n))
    after, busy, done = {pid: _ticks(pid) for pid in watched}, machine_busy() - busy, os.times()
    per = 1000 / os.sysconf("SC_CLK_TCK") / n

    def total(pids: list[int], which: int) -> float:
        return sum(after[pid][which] - before[pid][which] for pid in pids) * per

    client = ((done.user + done.system) - (me.user + me.system)) * 1000 / n
    rows = [("HTTP server (FastAPI, the pool)", total([server.proc.pid], 0)), ("load generator", client),
            ("zygotes", total(roles["zygote"], 0)), ("supervisors (the zygotes' children)", total(roles["zygote"], 1)),
            ("forkers", total(roles["forker"], 0)), ("programs (the forkers' children)", total(roles["forker"], 1))]
    rows.append(("the rest (kernel threads: namespace teardown, ...)", busy * 1000 / n - sum(v for _, v in rows)))
    rows.append(("machine, busy", busy * 1000 / n))
    return [(name, f"{value:.2f} ms") for name, value in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None, help="sandbox workers (default: the server's)")
    parser.add_argument("--baseline", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-split", action="store_true", help="where a request's CPU goes, by process role")
    args = parser.parse_args()
    if args.cpu_split:
        with ServerProcess(*(["--workers", str(args.workers)] if args.workers else []), "--max-sessions", "0") as ours:
            table(cpu_split(ours), "CPU per request of print(1+1) at concurrency 8, by role", ("metric", "CPU"))
        return
    if args.baseline is not None:
        import uvicorn

        uvicorn.run(baseline_app(), host="127.0.0.1", port=args.baseline, log_level="warning")
        return

    print(f"load average before: {load_average()} on {os.cpu_count()} CPUs")
    extra = ["--workers", str(args.workers)] if args.workers else []
    port = free_port()
    base = subprocess.Popen([sys.executable, __file__, "--baseline", str(port)])
    try:
        with ServerProcess(*extra, "--max-queue", "1024", "--max-sessions", "0") as ours:
            ServerProcess.wait_http(f"http://127.0.0.1:{port}/health", base)
            mine, theirs = asyncio.run(measure(ours.port, port))
            leaked = ours.leftovers(timeout=20)
    finally:
        base.terminate()
        base.wait()
    print(f"load average after: {load_average()}")

    def ms(key: str) -> tuple[str, str, str]:
        return f"{mine[key]:.1f} ms", f"{theirs[key]:.1f} ms", f"{theirs[key] / mine[key]:.1f}x faster"

    def rps(key: str) -> tuple[str, str, str]:
        return f"{mine[key]:.0f} req/s", f"{theirs[key]:.1f} req/s", f"{mine[key] / theirs[key]:.1f}x"

    table([
        ("print(1+1) latency p50", *ms("p50_trivial")),
        ("print(1+1) latency p99", *ms("p99_trivial")),
        ("numpy+sympy latency p50", *ms("p50_numeric")),
        ("numpy+sympy latency p99", *ms("p99_numeric")),
        ("throughput, concurrency 1", *rps("thr_1")),
        ("throughput, concurrency 8", *rps("thr_8")),
        ("throughput, concurrency 32", *rps("thr_32")),
    ])
    if leaked:
        print("left behind:", *leaked, sep="\n  ")


if __name__ == "__main__":
    main()
