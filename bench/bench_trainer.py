"""Where a colocated training step's time goes (one GPU: vLLM asleep while the FSDP2 learner trains).

Runs `agentrl train` on the ToRL task with the real sandbox, a random-weight model of a Qwen2.5 shape and
the real tokenizer, `--prompts` x `--n` samples per step, and prints each step's breakdown from
metrics.jsonl: generation (the rollout), learner compute (old logprobs and training), and everything else
(sleep, wake, weight push, checkpoint, logging), the last as a share of the step (checkpoints, every `save_every` steps, in a column of their own). Then, with the engine
awake, it times the weight push both ways in the same process: CUDA IPC (what the trainer uses) against
safetensors bytes through the host (the baseline), and prints their ratio.

`--lora RANK` trains a LoRA adapter of that rank (alpha 2 x rank) instead of the full weights, and the push
timed is the adapter's (what a LoRA run sends). Run it beside a full run of the same shape and batch for
the comparison; each prints the learner's peak GPU memory (the engine's share is fixed by
engine.gpu_memory_utilization). `--model-path` starts from a checkpoint on disk; `--random-checkpoint DIR`
from a random bf16 one of the shape written to DIR on the GPU (the trainer's own random init is built and
written in float32 on the CPU, slow for a 7B shape).

    python -m bench.bench_trainer --tokenizer <Qwen2.5 tokenizer dir> --shape qwen2.5-1.5b --steps 5
    python -m bench.bench_trainer --tokenizer <Qwen2.5 tokenizer dir> --shape qwen2.5-1.5b --steps 5 --lora 32
    python -m bench.bench_trainer --tokenizer <Qwen2.5 tokenizer dir> --shape qwen2.5-7b --random-checkpoint /tmp/q7b \
        --lora 32 --prompts 8
    python -m bench.bench_trainer --tokenizer <Qwen2.5 tokenizer dir> --shape qwen2.5-7b --random-checkpoint /tmp/q7b \
        --prompts 8 --ipc-only --set learner.activation_checkpointing=true learner.token_budget=4096 \
        engine.gpu_memory_utilization=0.14
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--model-path", default=None, help="a checkpoint of the shape to start from")
    parser.add_argument("--random-checkpoint", default=None, metavar="DIR",
                        help="start from a random bf16 checkpoint of --shape in DIR, written there on the GPU first "
                             "unless DIR holds one")
    parser.add_argument("--ipc-only", action="store_true",
                        help="after the run, time the CUDA IPC push alone (through the host, a 7B's 15 GB takes minutes)")
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    os.environ["AGENTRL_TOKENIZER"] = args.tokenizer
    sys.path.insert(0, str(REPO))
    os.chdir(REPO)
    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer
    from tests.gpu.test_trainer_gpu import gpu_run_config

    tmp = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    path = gpu_run_config(tmp, steps=args.steps, prompts=args.prompts, n=args.n, shape=args.shape,
                          response_tokens=args.response_tokens, eager=False)
    sets = ["algo.entropy_coef=0.001", "trainer.export=false", "learner.optim.lr=1e-6",
            "engine.gpu_memory_utilization=0.45"]
    if args.lora:
        sets += [f"model.lora.rank={args.lora}", f"model.lora.alpha={2 * args.lora}"]
    if args.random_checkpoint:
        args.model_path = str(_random_checkpoint(Path(args.random_checkpoint), args.tokenizer, args.shape))
    if args.model_path:
        sets += [f"model.path={args.model_path}", "model.config=null"]
    config = load_run_config(path, sets + args.set)
    import torch

    push = asyncio.run(_run(Trainer(config), ("ipc", "ipc") if args.ipc_only else ("ipc", "host", "ipc")))
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    metrics = [json.loads(line) for line in (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = []
    print(f"{'step':>4} {'step s':>8} {'rollout':>8} {'logprobs':>8} {'train':>8} {'sleep':>7} {'wake':>7} "
          f"{'push':>7} {'other':>7} {'other %':>8} {'ckpt':>7} {'tokens':>9}")
    for m in metrics:
        compute = m["timing/rollout"] + m["timing/logprobs"] + m["timing/train"]
        checkpoint = m.get("timing/checkpoint", 0.0)  # every save_every steps: its own column
        other = m["timing/step"] - compute - checkpoint
        row = {"step": m["step"], "step_s": m["timing/step"], "rollout_s": m["timing/rollout"],
               "logprobs_s": m["timing/logprobs"], "train_s": m["timing/train"], "sleep_s": m.get("timing/sleep", 0.0),
               "wake_s": m.get("timing/wake", 0.0), "push_s": m["timing/weight_sync"], "other_s": other,
               "other_share": other / (m["timing/step"] - checkpoint), "checkpoint_s": checkpoint,
               "tokens": m["perf/actor_tokens"], "train_tokens_per_s": m["perf/actor_tokens_per_s"],
               "mfu": m.get("perf/actor_mfu")}
        rows.append(row)
        print(f"{row['step']:>4} {row['step_s']:>8.2f} {row['rollout_s']:>8.2f} {row['logprobs_s']:>8.2f} "
              f"{row['train_s']:>8.2f} {row['sleep_s']:>7.2f} {row['wake_s']:>7.2f} {row['push_s']:>7.3f} "
              f"{row['other_s']:>7.2f} {100 * row['other_share']:>7.1f}% {row['checkpoint_s']:>7.1f} {row['tokens']:>9.0f}")
    later = rows[1:] or rows  # step 1 includes vLLM's first CUDA-graph warm-up of these shapes
    print(f"steps 2+: other {100 * sum(r['other_s'] for r in later) / sum(r['step_s'] - r['checkpoint_s'] for r in later):.1f}% of the "
          f"step; sleep + push + wake {max(r['sleep_s'] + r['push_s'] + r['wake_s'] for r in later):.2f} s at most")
    if args.lora:
        print(f"adapter push (rank {args.lora}), engine awake: {push['adapter_s']:.3f} s ({push['gb']:.3f} GB)")
    elif "host_s" in push:
        print(f"weight push, engine awake: CUDA IPC {push['ipc_s']:.3f} s, through the host {push['host_s']:.3f} s: "
              f"{push['host_s'] / push['ipc_s']:.1f}x ({push['gb']:.2f} GB of bf16 weights)")
    else:
        print(f"weight push, engine awake: CUDA IPC {push['ipc_s']:.3f} s ({push['gb']:.2f} GB of bf16 weights)")
    mean_step = sum(r["step_s"] - r["checkpoint_s"] for r in later) / len(later)
    print(f"learner peak GPU memory {peak_gib:.1f} GiB; mean step {mean_step:.2f} s less checkpoints, "
          f"train {sum(r['train_s'] for r in later) / len(later):.2f} s (steps 2+)")
    for r in later:  # the update alone: tokens/s and perf/actor_mfu (6·N·T against the device's listed peak)
        mfu = f", MFU {100 * r['mfu']:.1f}% of the listed peak" if r["mfu"] is not None else ""
        print(f"step {r['step']} update: {r['tokens']:.0f} tokens, {r['train_tokens_per_s']:,.0f} tokens/s{mfu}")
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": rows, "push": push, "peak_gib": peak_gib, "args": vars(args)},
                                             indent=1))


def _random_checkpoint(path: Path, tokenizer: str, shape: str) -> Path:
    """A random bf16 checkpoint of `shape` at `path`, written on the GPU unless one is there already."""
    if (path / "config.json").exists():
        return path
    from transformers import AutoTokenizer

    from agentrl.engine.random_model import write_random_checkpoint

    return write_random_checkpoint(path, AutoTokenizer.from_pretrained(tokenizer), shape, device="cuda",
                                   max_position_embeddings=4096)


async def _run(trainer, pushes: tuple[str, ...]) -> dict[str, float]:
    """Run the trainer, then time the push as the run makes it: the adapter's (LoRA), or the full weights' by
    each of `pushes` ("ipc": CUDA IPC, "host": safetensors bytes through the host; the last of a kind counts)."""
    from agentrl.weight_sync import push_weights

    try:
        await trainer.run()
        gb = sum(t.numel() * t.element_size() for _, t in trainer.learner.policy.state_for_sync()) / 1e9
        times = {}
        if trainer.config.model.lora is not None:  # the adapter, as the run pushes it
            for _ in range(3):
                start = time.perf_counter()
                await trainer.learner.push(trainer.engine)
                times["adapter_s"] = time.perf_counter() - start  # the last of three
            return times | {"gb": gb}
        for name in pushes:  # IPC twice: the first call may pay one-time costs
            start = time.perf_counter()
            await push_weights(trainer.learner.policy, trainer.engine, "ipc" if name == "ipc" else "tensors")
            times[f"{name}_s"] = time.perf_counter() - start
        return times | {"gb": gb}
    finally:
        await trainer.aclose()


if __name__ == "__main__":
    main()
