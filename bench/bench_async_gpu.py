"""Asynchronous against synchronous training on one GPU: training tokens/s and the GPU's busy fraction.

Runs `agentrl train` on the ToRL task with the real sandbox, a random-weight model of a Qwen2.5 shape and the
real tokenizer, vLLM and the FSDP2 learner on the one GPU, once per setting, each in a process of its own,
one after another, the config otherwise the same:
- `sync`: the synchronous trainer (vLLM asleep while the learner trains, then the weight push);
- `async:S`: trainer.mode async with max_staleness S: vLLM stays awake and generates the next groups while
  the learner trains on the last ones (in requests of trainer.chunk_tokens, so a push waits only for a
  token boundary);
- either followed by `+inproc`: engine.own_process false, vLLM's frontend in the trainer's process (by
  default it is in a child process of its own; weights go by CUDA IPC either way);
- and by `,key=value` config overrides of that setting alone, to compare a setting's variants in one run
  (`async:1,learner.reshard_after_forward=true`; values without commas). Each row's "vs sync" is against
  the sync row with the same overrides, else the first sync row.
Over steps 2+ (step 1 holds vLLM's CUDA-graph warm-up and, in async, the pipeline filling) it prints the
training tokens/s (tokens trained on per second of step time, checkpoints left out) and its ratio to
`sync`, the mean step's parts (rollout: generation in sync, the learner's wait for groups in async; drain:
the weight update's wait for the engine requests in flight to reach their chunk's end), and
the GPU's busy fraction: NVML's utilization (the share of time a kernel was running) sampled every 0.2 s
over those steps.

    python -m bench.bench_async_gpu --tokenizer <Qwen2.5 tokenizer dir> --settings sync async:1 async:2 --steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--settings", nargs="+", default=["sync", "async:1", "async:2"])
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    parser.add_argument("--engine-memory", type=float, default=0.4,
                        help="vLLM's gpu_memory_utilization (awake beside the learner in async settings: 0.2 on 80 GB)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: one setting
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _child(args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_async_gpu_check_") as tmp:
        for setting in args.settings:  # every setting's config loads before the first run starts an engine
            _config(args, setting, Path(tmp))
    rows = []
    for setting in args.settings:
        with tempfile.TemporaryDirectory(prefix="bench_async_gpu_") as tmp:
            result = Path(tmp) / "result.json"
            child = [sys.executable, "-m", "bench.bench_async_gpu", "--one", setting, "--result", str(result),
                     *_forward(args)]
            subprocess.run(child, check=True, cwd=REPO)
            rows.append(json.loads(result.read_text()))
        if args.out:  # after each setting: what finished survives a later one's failure
            Path(args.out).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    _print_table(args, rows)


def _baseline(rows: list[dict], setting: str) -> float:
    """tokens/s of the sync row with the same `,key=value` overrides as `setting`, else of the first sync row."""
    extra = setting.partition(",")[2]
    same = f"sync,{extra}" if extra else "sync"
    syncs = [r for r in rows if r["setting"] == same] or [r for r in rows if r["setting"].startswith("sync")]
    return syncs[0]["tokens_per_s"] if syncs else float("nan")


def _print_table(args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"\nsteps 2-{args.steps}, {args.prompts} prompts x {args.n} samples, {args.response_tokens} response tokens, "
          f"{args.shape}")
    print("vs sync: against the sync row with the same overrides (else the first sync row)")
    w = max([12, *(len(r["setting"]) for r in rows)])  # settings with overrides are longer than the default column
    print(f"{'setting':>{w}} {'tokens/s':>9} {'vs sync':>8} {'GPU busy':>9} {'step s':>7} {'rollout':>7} {'logprobs':>8} "
          f"{'train':>6} {'sync':>6} {'drain':>6} {'sleep+wake':>10} {'staleness':>9} {'dropped':>7} {'partial':>7}")
    for r in rows:
        ratio = r["tokens_per_s"] / _baseline(rows, r["setting"])
        print(f"{r['setting']:>{w}} {r['tokens_per_s']:>9.0f} {ratio:>8.2f} {100 * r['gpu_busy']:>8.1f}% "
              f"{r['step_s']:>7.2f} {r['rollout_s']:>7.2f} {r['logprobs_s']:>8.2f} {r['train_s']:>6.2f} "
              f"{r['sync_s']:>6.2f} {r['update_wait_s']:>6.2f} {r['sleep_wake_s']:>10.2f} {r['staleness']:>9.2f} {r['dropped']:>7.0f} "
              f"{100 * r['partial']:>6.1f}%")


SETTING = "sync or async:S (S the max staleness, an integer), then optionally +inproc and ,key=value overrides"


def _parse(setting: str) -> list[str]:
    """The config overrides of a setting: `sync` or `async:S`, then `+inproc`, then `,key=value` each."""
    mode, *extra = setting.split(",")
    bad = [e for e in extra if "=" not in e or not e.partition("=")[0]]
    if bad:
        sys.exit(f"setting {setting!r}: override {bad[0]!r} is not key=value; expected {SETTING}")
    base, _, where = mode.partition("+")
    if where not in ("", "inproc"):
        sys.exit(f"setting {setting!r}: expected {SETTING}")
    sets = ["engine.own_process=false"] if where else []
    if base != "sync":
        kind, _, staleness = base.partition(":")
        if kind != "async" or not staleness.isdigit():
            sys.exit(f"setting {setting!r}: expected {SETTING}")
        sets += ["trainer.mode=async", f"trainer.max_staleness={staleness}"]
    return [*sets, *extra]


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--tokenizer", args.tokenizer, "--shape", args.shape, "--steps", str(args.steps), "--prompts",
            str(args.prompts), "--n", str(args.n), "--response-tokens", str(args.response_tokens),
            "--engine-memory", str(args.engine_memory)]


class BusySampler:
    """GPU 0's utilization (NVML, through nvidia-smi) every `interval_s`, with the time of each reading."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.samples = interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        query = ["nvidia-smi", "--id=0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.interval_s):
            out = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
            if out.isdigit():
                self.samples.append((time.time(), int(out) / 100))

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mean(self, start: float, end: float) -> float:
        inside = [u for t, u in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else float("nan")


def _config(args: argparse.Namespace, setting: str, tmp: Path):
    """The run config of `setting` (its run dir under `tmp`); a bad override fails here, naming it."""
    os.environ["AGENTRL_TOKENIZER"] = args.tokenizer
    if str(REPO) not in sys.path:  # the parent loads every setting's config, one after another
        sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    from agentrl.config import ConfigError
    from agentrl.run_config import load_run_config
    from tests.gpu.test_trainer_gpu import gpu_run_config

    path = gpu_run_config(tmp, steps=args.steps, prompts=args.prompts, n=args.n, shape=args.shape,
                          response_tokens=args.response_tokens, eager=False)
    try:
        return load_run_config(path, ["algo.entropy_coef=0.001", "trainer.export=false", "learner.optim.lr=1e-6",
                                      f"engine.gpu_memory_utilization={args.engine_memory}", *_parse(setting)])
    except ConfigError as e:
        sys.exit(f"setting {setting!r}: {e}")


def _child(args: argparse.Namespace) -> None:
    from agentrl.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="bench_async_gpu_run_"))
    try:
        config = _config(args, args.one, tmp)
        starts: dict[int, float] = {}
        trainer = Trainer(config, on_step_start=lambda step: starts.setdefault(step, time.time()))
        with BusySampler() as busy:
            asyncio.run(_run(trainer))
        metrics = [json.loads(line) for line in (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # checkpoints: gigabytes
    later = metrics[1:] or metrics
    step_s = [m["timing/step"] - m.get("timing/checkpoint", 0.0) for m in later]
    window = (starts[later[0]["step"]], starts[later[-1]["step"]] + step_s[-1])

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in later) / len(later)

    row = {"setting": args.one, "tokens_per_s": sum(m["perf/actor_tokens"] for m in later) / sum(step_s),
           "gpu_busy": busy.mean(*window), "step_s": sum(step_s) / len(step_s), "rollout_s": mean("timing/rollout"),
           "logprobs_s": mean("timing/logprobs"), "train_s": mean("timing/train"), "sync_s": mean("timing/weight_sync"),
           "update_wait_s": mean("timing/update_wait"),
           "sleep_wake_s": mean("timing/sleep") + mean("timing/wake"), "staleness": mean("async/staleness_mean"),
           "dropped": sum(m.get("async/dropped_stale", 0.0) for m in later),
           "partial": mean("async/partial_trajectories"), "steps": metrics}
    print(f"{args.one}: " + ", ".join(f"step {m['step']} {m['timing/step']:.1f} s" for m in metrics))
    Path(args.result).write_text(json.dumps(row))


async def _run(trainer) -> None:
    try:
        await trainer.run()
    finally:
        await trainer.aclose()


if __name__ == "__main__":
    main()
