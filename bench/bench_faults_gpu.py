"""A run that survives its faults: the code quickstart's GRPO run with its engine process killed and its
sandbox killed in the middle of steps, timed.

Prepares the quickstart's code data and tokenizer, runs `agentrl sft`, then `agentrl train`'s loop on
configs/quickstart_code.yaml for `--steps` steps with the engine in a process of its own (vLLM on the GPU by
default, `--engine hf` for the transformers engine on the CPU). At the steps named, a timer started when
the step opens kills (SIGKILL) the engine process or the sandbox's process group `--delay` seconds later,
while the step's rollouts are under way. It prints, per fault, the time from the kill until the run was
whole again (the engine restarted and given the learner's weights, checked by the push probe; the sandbox
answering again), the push check's share of a step and its largest logprob gap, the faults the metrics
counted, and whether the run still learned (the training reward of the first and last five steps, and with
`--eval` the held-out pass@1 of the SFT checkpoint and of the run's export).

    python -m bench.bench_faults_gpu --steps 30 --kill-engine 8 20 --kill-sandbox 14 --eval
    python -m bench.bench_faults_gpu --engine hf --steps 6 --kill-engine 2 --kill-sandbox 4   # on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> None:
    from agentrl.cli import app

    result = CliRunner().invoke(app, list(args))
    if result.exit_code != 0:
        raise RuntimeError(f"agentrl {args[0]} failed: {result.output}") from result.exception


def _eval(qs: Path, run: str, engine: str) -> float:
    _cli("eval", "--engine", engine, "--benchmarks", "task", "--limit", "200", "--n", "4", "--temperature", "1",
         "--task", "tasks/quickstart_code.yaml", "--set", f"dataset.path={qs}/code/test.jsonl",
         "--model", str(qs / run / "export"), "--out", str(qs / run / "eval"))
    return json.loads((qs / run / "eval/results.json").read_text())["results"]["task"]["pass@1"]


class Faults:
    """Kills at the steps named and the times the run took to be whole again."""

    def __init__(self, steps: dict[str, list[int]], delay_s: float) -> None:
        self.steps, self.delay_s = steps, delay_s
        self.killed: dict[str, list[float]] = {what: [] for what in steps}
        self.whole: dict[str, list[float]] = {what: [] for what in steps}
        self.trainer, self.last_engine_kill = None, "engine"

    def at_step_start(self, step: int) -> None:
        for what, steps in self.steps.items():
            if step in steps:
                threading.Timer(self.delay_s, self._kill, (what,)).start()

    def _kill(self, what: str) -> None:
        self.killed[what].append(time.perf_counter())
        if what != "sandbox":
            self.last_engine_kill = what
        engine = self.trainer.engine.process.pid
        if what == "engine":
            os.kill(engine, signal.SIGKILL)
        elif what == "core":  # the engine's own children (vLLM's engine core), not the engine process
            with open(f"/proc/{engine}/task/{engine}/children") as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
        else:
            os.killpg(self.trainer.services.managed[0].proc.pid, signal.SIGKILL)

    def instrument(self) -> None:
        """Time the trainer's engine revival (restart + checked push) and the sandbox's restart."""
        from agentrl.services import ServiceProcess
        from agentrl.trainer import Trainer

        revive_engine, revive_service = Trainer._revive_engine, ServiceProcess.revive

        async def engine_back(trainer) -> None:
            await revive_engine(trainer)
            what = self.last_engine_kill  # kills come at distinct steps
            self.whole[what].append(time.perf_counter())
            print(f"recovered: {what} in {self.whole[what][-1] - self.killed[what][-1]:.1f} s", flush=True)

        def service_back(service) -> bool:
            revived = revive_service(service)
            if revived and self.killed["sandbox"]:
                self.whole["sandbox"].append(time.perf_counter())
                print(f"recovered: sandbox in {self.whole['sandbox'][-1] - self.killed['sandbox'][-1]:.1f} s", flush=True)
            return revived

        Trainer._revive_engine, ServiceProcess.revive = engine_back, service_back


def _train(args: argparse.Namespace, qs: Path, faults: Faults) -> tuple[list[dict], str | None]:
    """The run's metrics, and why it stopped early (None: it finished)."""
    from agentrl.engine.process import ProcessEngine
    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer

    sets = [f"model.path={qs}/code_sft/export", f"task.dataset.path={qs}/code/train.jsonl",
            f"trainer.run_dir={qs}/code_rl", f"trainer.steps={args.steps}", "trainer.save_every=0",
            "logging.progress=false"]
    engine = None
    if args.engine == "vllm":
        sets += ["engine.kind=vllm", "engine.own_process=true", "engine.gpu_memory_utilization=0.25",
                 "learner.device=cuda"]
    else:  # the transformers engine in a child process, as vLLM is by default
        engine = ProcessEngine("agentrl.engine.hf:HFEngine.from_pretrained",
                               {"path": f"{qs}/code_sft/export", "seed": 0, "dtype": "float32"})
    shutil.rmtree(qs / "code_rl", ignore_errors=True)  # a fresh run, not a resume of the last one
    config = load_run_config(REPO / "configs/quickstart_code.yaml", sets)
    faults.instrument()
    trainer = Trainer(config, engine=engine, on_step_start=faults.at_step_start)
    faults.trainer = trainer
    stopped = None
    try:
        asyncio.run(trainer.run())
    except Exception as e:  # the figures of the steps that finished are still printed
        stopped = f"{type(e).__name__}: {e}"
    finally:
        if engine is not None:
            asyncio.run(engine.aclose())
    lines = (qs / "code_rl/metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-engine", type=int, nargs="*", default=[8, 20], help="steps whose engine is killed")
    parser.add_argument("--kill-sandbox", type=int, nargs="*", default=[14], help="steps whose sandbox is killed")
    parser.add_argument("--kill-core", type=int, nargs="*", default=[], help="steps whose engine's own children "
                        "(vLLM's engine core) are killed, the engine process left running")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds into the step when the kill comes")
    parser.add_argument("--eval", action="store_true", help="held-out pass@1 before and after")
    parser.add_argument("--workdir", default=None, help="kept; the data and SFT checkpoint already there are used again")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    os.chdir(REPO)
    from agentrl.quickstart.__main__ import prepare_to

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_faults_"))
    qs = workdir / "qs"
    if not qs.exists():  # a --workdir's data is used again
        prepare_to(qs, search=False, progress=False)
    device = "cuda" if args.engine == "vllm" else "cpu"
    start = time.perf_counter()
    if not (qs / "code_sft/export/config.json").exists():  # a --workdir's SFT checkpoint is used again
        _cli("sft", "configs/quickstart_code_sft.yaml", "--set", f"data={qs}/code/traces.jsonl",
             "--set", f"model.tokenizer={qs}/tokenizer", "--set", f"trainer.run_dir={qs}/code_sft",
             "--set", f"learner.device={device}", "--set", "logging.progress=false")
    sft_s = time.perf_counter() - start
    faults = Faults({"engine": args.kill_engine, "sandbox": args.kill_sandbox, "core": args.kill_core}, args.delay)
    start = time.perf_counter()
    metrics, stopped = _train(args, qs, faults)
    train_s = time.perf_counter() - start
    evals = {run: _eval(qs, run, args.engine) for run in ("code_sft", "code_rl")} if args.eval else {}

    recoveries = {what: [b - a for a, b in zip(faults.killed[what], faults.whole[what], strict=False)] for what in faults.killed}
    probe_share = [m["timing/probe"] / m["timing/step"] for m in metrics if "timing/probe" in m]
    reward = [m["reward/mean"] for m in metrics]
    last = metrics[-1]
    figures = {
        "steps": len(metrics), "sft_s": sft_s, "train_s": train_s,
        "stopped": stopped, "kills": {what: len(times) for what, times in faults.killed.items()},
        "recovery_s": recoveries, "engine_restarts": last.get("engine/restarts", 0.0),
        "sandbox_restarts": last.get("services/sandbox_restarts", 0.0),
        "errored_trajectories": sum(m.get("rollout/errored", 0.0) for m in metrics),
        "probe_share_mean": sum(probe_share) / max(len(probe_share), 1), "probe_share_max": max(probe_share, default=0),
        "probe_gap_max": max(m.get("sync/probe_gap", 0.0) for m in metrics),
        "reward_first5": sum(reward[:5]) / len(reward[:5]), "reward_last5": sum(reward[-5:]) / len(reward[-5:]),
        "pass@1": evals,
    }
    print("| what | figure |\n|---|---|")
    print(f"| steps finished | {figures['steps']} of {args.steps} (train {train_s:.0f} s, sft {sft_s:.0f} s) |")
    if stopped:
        print(f"| stopped by | {stopped.splitlines()[0][:300]} |")
    print(f"| kills (engine process, its engine core, sandbox) | {figures['kills']['engine']}, "
          f"{figures['kills']['core']}, {figures['kills']['sandbox']} |")
    print(f"| restarts counted (engine, sandbox) | {figures['engine_restarts']:.0f}, {figures['sandbox_restarts']:.0f} |")
    for what in ("engine", "core", "sandbox"):
        if recoveries[what]:
            print(f"| {what} killed: to whole again | {', '.join(f'{t:.1f} s' for t in recoveries[what])} |")
    print(f"| errored trajectories (left out of the loss) | {figures['errored_trajectories']:.3f} (sum of step fractions) |")
    print(f"| push check: share of a step | {figures['probe_share_mean']:.1%} mean, {figures['probe_share_max']:.1%} max |")
    print(f"| push check: largest engine-learner logprob gap | {figures['probe_gap_max']:.2e} |")
    print(f"| training reward, first 5 steps -> last 5 | {figures['reward_first5']:.3f} -> {figures['reward_last5']:.3f} |")
    if evals:
        print(f"| held-out pass@1, SFT -> RL | {evals['code_sft']:.1%} -> {evals['code_rl']:.1%} |")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
