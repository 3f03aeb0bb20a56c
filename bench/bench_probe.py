"""The cost of checking every weight push (weight_sync.PushProbe) on the CPU: the same run of
configs/debug_cpu.yaml (the transformers engine, the real sandbox) with the check on and off, alternating,
in one process. Prints the mean step time of each, their ratio, the probe's own time as a share of the
step, and the largest gap the probe saw (the engine's numerics against the learner's).

    python -m bench.bench_probe --steps 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]


def _run(root: Path, steps: int, probe_tokens: int) -> list[dict]:
    from agentrl.run_config import load_run_config
    from agentrl.trainer import train

    config = load_run_config(REPO / "configs" / "debug_cpu.yaml", [
        f"trainer.run_dir={root}", f"trainer.steps={steps}", f"trainer.probe_tokens={probe_tokens}",
        "trainer.eval_every=0", "trainer.export=false", "trainer.save_every=0", "logging.progress=false"])
    run = train(config).root
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]  # step 1: warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--probe-tokens", type=int, default=32)
    args = parser.parse_args()
    os.chdir(REPO)
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, tokens in (("off", 0), ("on", args.probe_tokens)):
                rows[name] += _run(Path(tmp) / f"{name}{i}", args.steps, tokens)
    step = {name: statistics.mean(r["timing/step"] for r in rs) for name, rs in rows.items()}
    probe = statistics.mean(r["timing/probe"] for r in rows["on"])
    table = Table(title=f"push check on configs/debug_cpu.yaml: {args.steps - 1} steps x {args.repeats} runs each")
    for column in ("step, check off (s)", "step, check on (s)", "on / off", "probe / step", "largest gap"):
        table.add_column(column)
    table.add_row(f"{step['off']:.3f}", f"{step['on']:.3f}", f"{step['on'] / step['off']:.3f}x",
                  f"{probe / step['on']:.1%}", f"{max(r['sync/probe_gap'] for r in rows['on']):.1e}")
    Console().print(table)


if __name__ == "__main__":
    main()
