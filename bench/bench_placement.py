"""The trainer on Ray, on the GPUs of this machine: where a step's time goes in each placement mode, and what
the weight sync costs.

Starts a Ray head (`ray start --head`), then runs `agentrl train` on the ToRL task with the real sandbox, a
random-weight model of a Qwen2.5 shape and the real tokenizer, one learner rank and one vLLM engine as
actors, in each mode asked for:
- colocated: the engine on the learner's GPU, asleep while it trains, weights by CUDA IPC;
- split: the engine on a GPU of its own, weights broadcast over NCCL; with one GPU (`--share-gpus`, the
  default where there is one) the two processes share it, and NCCL carries the broadcast as between two hosts.
It prints each step's breakdown from metrics.jsonl (rollout, old logprobs, training, sleep, wake, weight
sync, the rest) and the weight sync's rate over the model's bf16 bytes, against the targets (colocated push
<= 0.5 s, split broadcast <= 1 s for the 1.5B shape).

    python -m bench.bench_placement --tokenizer <Qwen2.5 tokenizer dir> --modes colocated split --steps 3
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = {"colocated": 0.5, "split": 1.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--modes", nargs="+", choices=["colocated", "split"], default=["colocated", "split"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs (starts faster)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    os.environ["AGENTRL_TOKENIZER"] = args.tokenizer
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    from tests.conftest import ray_token_mode

    ray_token_mode()
    import torch

    from agentrl.learner.fsdp import free_port
    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer
    from tests.gpu.test_trainer_gpu import gpu_run_config

    gpus = torch.cuda.device_count()
    port = free_port()
    ray_bin = [sys.executable, "-m", "ray.scripts.scripts"]  # Ray's CLI, wherever its package is
    subprocess.run([*ray_bin, "start", "--head", f"--port={port}", f"--num-gpus={gpus}", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True)
    results = {}
    try:
        for mode in args.modes:
            tmp = Path(tempfile.mkdtemp(prefix=f"bench_placement_{mode}_"))
            path = gpu_run_config(tmp, steps=args.steps, prompts=args.prompts, n=args.n, shape=args.shape,
                                  response_tokens=args.response_tokens, eager=args.eager)
            sets = ["algo.entropy_coef=0.001", "trainer.export=false", "learner.optim.lr=1e-6",
                    "engine.gpu_memory_utilization=0.4", f"placement.ray_address=127.0.0.1:{port}",
                    f"placement.mode={mode}"]
            if mode == "split" and gpus < 2:
                sets.append("placement.share_gpus=true")
            config = load_run_config(path, sets)
            trainer = Trainer(config)
            gb = asyncio.run(_run(trainer))
            metrics = [json.loads(line) for line in (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()]
            results[mode] = {"steps": _table(mode, metrics, gb), "gb": gb}
            shutil.rmtree(tmp)  # the run's checkpoints: gigabytes a mode
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([*ray_bin, "stop", "--force"], check=False, capture_output=True)
    print(f"\n{'mode':>10} {'weight sync s (steps 2+, max)':>30} {'GB/s':>7} {'target s':>9}")
    for mode, r in results.items():
        later = r["steps"][1:] or r["steps"]
        worst = max(row["sync_s"] for row in later)
        print(f"{mode:>10} {worst:>30.3f} {r['gb'] / worst:>7.1f} {TARGET_S[mode]:>9.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "args": vars(args), "gpus": gpus}, indent=1))


async def _run(trainer) -> float:
    """Run the trainer; the GB of bf16 weights a push moves."""
    try:
        await trainer.run()
    finally:
        await trainer.aclose()
    from transformers import AutoConfig, AutoModelForCausalLM

    with __import__("torch").device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(Path(trainer.config.run_dir) / "init"))
    return sum(p.numel() for p in model.parameters()) * 2 / 1e9  # parameters(): tied embeddings once


def _table(mode: str, metrics: list[dict], gb: float) -> list[dict]:
    print(f"\n{mode}: {gb:.2f} GB of bf16 weights per sync")
    print(f"{'step':>4} {'step s':>8} {'rollout':>8} {'logprobs':>8} {'train':>8} {'sleep':>7} {'wake':>7} "
          f"{'sync':>7} {'other':>7} {'tokens/s':>9}")
    rows = []
    for m in metrics:
        parts = ["timing/rollout", "timing/logprobs", "timing/train", "timing/sleep", "timing/wake", "timing/weight_sync"]
        other = m["timing/step"] - sum(m.get(k, 0.0) for k in parts) - m.get("timing/checkpoint", 0.0)
        row = {"step": m["step"], "step_s": m["timing/step"], "rollout_s": m["timing/rollout"],
               "logprobs_s": m["timing/logprobs"], "train_s": m["timing/train"], "sleep_s": m.get("timing/sleep", 0.0),
               "wake_s": m.get("timing/wake", 0.0), "sync_s": m["timing/weight_sync"], "other_s": other,
               "tokens_per_s": m["perf/actor_tokens"] / m["timing/step"]}
        rows.append(row)
        print(f"{row['step']:>4} {row['step_s']:>8.2f} {row['rollout_s']:>8.2f} {row['logprobs_s']:>8.2f} "
              f"{row['train_s']:>8.2f} {row['sleep_s']:>7.2f} {row['wake_s']:>7.2f} {row['sync_s']:>7.3f} "
              f"{row['other_s']:>7.2f} {row['tokens_per_s']:>9.0f}")
    return rows


if __name__ == "__main__":
    main()
