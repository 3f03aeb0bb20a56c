"""Asynchronous against synchronous training on the CPU quickstart: the same learning, and the throughput.

Runs the quickstart's code RL stage (configs/quickstart_code.yaml: GRPO from the SFT checkpoint, the real
sandbox, the transformers engine) once per setting and seed, then evaluates each export on the held-out
problems as `make demo` does (200 problems x 4 samples at temperature 1). A setting is `sync`, or
`async:S` (trainer.mode async, max_staleness S), optionally followed by `:behaviour` (the PPO ratio
against the engine's logprobs: no off-policy correction) or `:tisC` (importance weights of the proximal
against the behaviour policy, capped at C). Prints held-out accuracy, tool-call rate, the training
tokens/s over the run and its ratio to the synchronous run of the same seed, and what was dropped.
Needs `make demo` (or its prepare and SFT steps) to have written runs/quickstart first.

    python -m bench.bench_async --settings sync async:2 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "runs" / "quickstart"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", default=["sync", "async:2"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "runs" / "bench_async"))
    args = parser.parse_args()
    if not (QS / "code_sft" / "export" / "config.json").exists():
        sys.exit(f"{QS / 'code_sft/export'} is missing: run `make demo` first (its prepare and SFT steps)")
    os.chdir(REPO)
    rows = []
    for seed in args.seeds:
        for setting in args.settings:
            rows.append(_one(setting, seed, args.steps, Path(args.out)))
    base = {r["seed"]: r["tokens_per_s"] for r in rows if r["setting"] == "sync"}
    print(f"\n{'setting':>20} {'seed':>4} {'held-out':>9} {'tool rate':>9} {'train s':>8} {'tokens/s':>9} "
          f"{'vs sync':>7} {'dropped':>7} {'staleness':>9}")
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["seed"]] if r["seed"] in base else float("nan")
        print(f"{r['setting']:>20} {r['seed']:>4} {100 * r['accuracy']:>8.1f}% {100 * r['tool_rate']:>8.1f}% "
              f"{r['train_s']:>8.0f} {r['tokens_per_s']:>9.0f} {ratio:>7.2f} {r['dropped']:>7.0f} {r['staleness']:>9.2f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))


def _one(setting: str, seed: int, steps: int, out: Path) -> dict:
    from agentrl.run_config import load_run_config
    from agentrl.trainer import train

    parts = setting.split(":")
    name = f"{setting.replace(':', '_')}_seed{seed}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: one left here would be resumed, not measured
    sets = [f"trainer.run_dir={run_dir}", f"trainer.seed={seed}", f"trainer.steps={steps}", "logging.progress=false"]
    if parts[0] == "async":
        sets += ["trainer.mode=async", f"trainer.max_staleness={parts[1]}"]
    for part in parts[2:]:
        if part == "behaviour":
            sets.append("algo.off_policy=behaviour")
        elif part.startswith("tis"):
            sets.append(f"algo.tis_cap={part[3:]}")
        else:
            sys.exit(f"setting {setting!r}: {part!r} is not behaviour or tis<cap>")
    config = load_run_config(REPO / "configs/quickstart_code.yaml", sets)
    start = time.perf_counter()
    train(config)
    train_s = time.perf_counter() - start
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--benchmarks", "task", "--limit", "200", "--n", "4",
                    "--temperature", "1", "--task", "tasks/quickstart_code.yaml",
                    "--set", f"dataset.path={QS / 'code/test.jsonl'}", "--model", str(run_dir / "export"),
                    "--out", str(run_dir / "eval")], check=True, capture_output=True)
    result = json.loads((run_dir / "eval" / "results.json").read_text())["results"]["task"]
    return {"setting": setting, "seed": seed, "accuracy": result["pass@1"], "tool_rate": result["tool_call_rate"],
            "train_s": train_s, "tokens_per_s": sum(m["perf/actor_tokens"] for m in metrics)
            / sum(m["timing/step"] for m in metrics),
            "dropped": sum(m.get("async/dropped_stale", 0.0) for m in metrics),
            "staleness": sum(m.get("async/staleness_mean", 0.0) for m in metrics) / len(metrics)}


if __name__ == "__main__":
    main()
