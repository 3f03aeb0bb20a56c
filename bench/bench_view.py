"""How `agentrl view` holds up on a large run: 200 steps of 512 samples, each sample a multi-turn trajectory
with its per-token arrays (agentrl/samples.py's records), served through the viewer's HTTP API
(agentrl/view/server.py, in process). Prints the time and bytes of what the page asks for when a step is
opened (its summaries, cold and cached) and when a trajectory is opened, against the baseline of taking the
step whole (reading and parsing its file: what a page without the index would have to fetch).

    python -m bench.bench_view --steps 200 --samples 512

The step files are one generated file hard-linked 200 times (the viewer reads each as its own file).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def record(rng: random.Random, i: int, turn_tokens: int) -> dict:
    """A sample like the trainer dumps: model turn, tool output, model turn, with every per-token array."""
    def model(n: int, version: int) -> dict:
        ids = [rng.randrange(150_000) for _ in range(n)]
        return {"source": "model", "text": "x" * (4 * n), "tokens": n, "ids": ids,
                "pieces": [f"tok{t % 997}" for t in ids], "logprobs": [round(-rng.random() * 3, 5) for _ in ids],
                "learner_logprobs": [round(-rng.random() * 3, 5) for _ in ids], "version": version}

    tool_ids = [rng.randrange(150_000) for _ in range(turn_tokens // 4)]
    tool = {"source": "tool", "text": "y" * len(tool_ids) * 4, "tokens": len(tool_ids), "ids": tool_ids,
            "pieces": [f"tok{t % 997}" for t in tool_ids]}
    return {"id": f"p{i // 8}", "sample": i % 8, "stop_reason": "eos", "reward": {"score": float(i % 2)},
            "error": None, "advantage": 0.5, "prompt": "Question " * 40,
            "segments": [model(turn_tokens, 7), tool, model(turn_tokens // 2, 8)],
            "tool_calls": [{"turn": 1, "name": "python", "arguments": {"code": "print(1)"}, "error": None,
                            "latency_ms": 12.0}], "ground_truth": "1", "timings": {}}


def make_run(root: Path, steps: int, samples: int, turn_tokens: int) -> int:
    from agentrl.samples import index_path, write_index

    rng = random.Random(0)
    (root / "samples").mkdir(parents=True)
    first = root / "samples/step_1.jsonl"
    records = [record(rng, i, turn_tokens) for i in range(samples)]
    lines = [json.dumps(r) + "\n" for r in records]
    first.write_text("".join(lines))
    write_index(first, records, [sum(len(x) for x in lines[:i]) for i in range(len(lines))])  # as the trainer does
    for step in range(2, steps + 1):
        os.link(first, root / f"samples/step_{step}.jsonl")
        os.link(index_path(first), index_path(root / f"samples/step_{step}.jsonl"))
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                                for s in range(1, steps + 1)))
    return first.stat().st_size


def timed(fn, repeats: int = 5) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=400, help="tokens of the first model turn")
    args = parser.parse_args()
    from fastapi.testclient import TestClient

    from agentrl.view.server import app_for

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        step_bytes = make_run(root, args.steps, args.samples, args.turn_tokens)
        client = TestClient(app_for([root]), base_url="http://127.0.0.1")
        rows = []
        t, runs = timed(lambda: client.get("/api/runs"))
        rows.append(("list the runs and their steps", t, len(runs.content)))
        whole_t, _ = timed(lambda: [json.loads(line) for line in (root / "samples/step_1.jsonl").open("rb")])
        rows.append(("baseline: take a step whole (read and parse its file)", whole_t, step_bytes))
        cold = []
        for step in range(2, 7):  # a step never opened: its index is read
            start = time.perf_counter()
            page = client.get(f"/api/runs/run/steps/{step}")
            cold.append(time.perf_counter() - start)
        rows.append(("open a step: its summaries, first time", statistics.median(cold), len(page.content)))
        t, page = timed(lambda: client.get("/api/runs/run/steps/2"))
        rows.append(("open a step again (summaries cached)", t, len(page.content)))
        t, page = timed(lambda: client.get("/api/runs/run/steps/2", params={"tool": "called", "q": "question"}))
        rows.append(("filter a step (tool called, text search)", t, len(page.content)))
        t, one = timed(lambda: client.get(f"/api/runs/run/steps/2/{args.samples // 2}"))
        rows.append(("open one trajectory", t, len(one.content)))
        t, across = timed(lambda: client.get("/api/runs/run/prompts/p3"), repeats=1)
        rows.append((f"a prompt across all {args.steps} steps (every index read)", t, len(across.content)))
        (root / "samples/step_9.index.json").unlink()  # a step without its index: read the samples instead
        fresh = TestClient(app_for([root]), base_url="http://127.0.0.1")  # nothing cached
        t, page = timed(lambda: fresh.get("/api/runs/run/steps/9"), repeats=1)
        rows.append(("open a step without its index (read whole once)", t, len(page.content)))

    table = Table(title=f"agentrl view, {args.steps} steps x {args.samples} samples "
                        f"({step_bytes / 1e6:.1f} MB a step)")
    for col in ("request", "median time", "bytes", "against the whole step"):
        table.add_column(col, justify="right" if col != "request" else "left")
    for what, seconds, size in rows:
        table.add_row(what, f"{seconds * 1000:.1f} ms", f"{size:,}",
                      f"{whole_t / seconds:.1f}x faster" if seconds < whole_t else f"{seconds / whole_t:.1f}x slower")
    Console().print(table)


if __name__ == "__main__":
    main()
