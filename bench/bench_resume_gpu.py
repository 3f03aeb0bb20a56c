"""Does a resumed run sample what the uninterrupted one did, on the GPU with vLLM? And what do per-request
seeds (engine.request_seeds) cost vLLM's generation?

Part 1, for request seeds off and on: a 3-step run (a checkpoint every step) and the same run stopped after
step 2 and resumed to step 3, both colocated on one GPU (a random-weight Qwen2.5-0.5B shape, the real
Qwen2.5 tokenizer, the ToRL task with the real sandbox). It compares step 3's trajectories of the two, token
for token: whole trajectories, and each one's first model turn (sampled before any tool call, so in the same
engine batches in both runs).

Part 2: one vLLM engine generates the same requests with and without per-request seeds, alternating, and
prints generated tokens/s of each (the ratio is the seeds' cost).

    python bench/bench_resume_gpu.py [--prompts 16] [--n 8] [--requests 512] [--tokens 256]
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _samples(run: Path, step: int) -> list[dict]:
    rows = [json.loads(line) for line in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["id"], r["sample"]))


def _model_turns(row: dict) -> list[str]:
    return [s["text"] for s in row["segments"] if s["source"] == "model"]


def resume_matches(tmp: Path, seeds: bool, prompts: int, n: int) -> dict[str, float]:
    from agentrl.run_config import load_run_config
    from agentrl.trainer import train
    from tests.gpu.test_trainer_gpu import gpu_run_config

    sets = [f"engine.request_seeds={str(seeds).lower()}", "trainer.save_every=1", "trainer.export=false",
            "algo.entropy_coef=0.01", "learner.optim.lr=1e-4"]
    runs = {}
    for name, steps in (("whole", 3), ("part", 2), ("part", 3)):  # the second "part" resumes the first
        base = gpu_run_config(tmp / f"{name}-{seeds}", steps=steps, prompts=prompts, n=n, samples_per_step=prompts * n)
        config = load_run_config(base, sets + [f"trainer.run_dir={tmp / f'{name}-{seeds}' / 'run'}"])
        runs[name] = train(config).root
    whole, resumed = _samples(runs["whole"], 3), _samples(runs["part"], 3)
    first_whole, first_part = _samples(runs["whole"], 1), _samples(runs["part"], 1)
    assert [(r["id"], r["sample"]) for r in whole] == [(r["id"], r["sample"]) for r in resumed]
    same = sum(a["segments"] == b["segments"] for a, b in zip(whole, resumed, strict=True))
    first = sum(_model_turns(a)[:1] == _model_turns(b)[:1] for a, b in zip(whole, resumed, strict=True))
    fresh = sum(a["segments"] == b["segments"] for a, b in zip(first_whole, first_part, strict=True))
    return {"trajectories": len(whole), "step3_same": same / len(whole), "step3_first_turn_same": first / len(whole),
            "step1_same": fresh / len(first_whole)}


async def seed_cost(model_dir: str, requests: int, tokens: int, rounds: int = 2) -> dict[str, float]:
    from transformers import AutoTokenizer

    from agentrl.engine import Sampling
    from agentrl.engine.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = VLLMEngine(model_dir, gpu_memory_utilization=0.5, max_model_len=2048, admission_interval_ms=0)
    prompts = [tok.encode(f"Problem {i}: what is {i} + {i * 7 % 13}? Let us think.") for i in range(requests)]
    out: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for r in range(rounds + 1):  # round 0 warms up (CUDA graphs, caches)
            for mode in ("off", "on"):
                engine.use_request_seeds = mode == "on"
                start = time.perf_counter()
                done = await asyncio.gather(*(engine.generate(p, Sampling(max_tokens=tokens, temperature=1.0,
                                                                            seed=1000 * r + i))
                                              for i, p in enumerate(prompts)))
                elapsed = time.perf_counter() - start
                if r:
                    out[mode].append(sum(len(c.token_ids) for c in done) / elapsed)
    finally:
        await engine.aclose()
    return {mode: sum(v) / len(v) for mode, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default=os.environ.get("OUT", ""))
    args = parser.parse_args()
    os.chdir(REPO)
    tmp = Path(tempfile.mkdtemp(prefix="resume-"))
    results = {}
    for seeds in (False, True):
        results[f"request_seeds={seeds}"] = resume_matches(tmp, seeds, args.prompts, args.n)
        print(json.dumps({f"request_seeds={seeds}": results[f"request_seeds={seeds}"]}), flush=True)
    model_dir = str(tmp / "whole-True" / "run" / "init")
    cost = asyncio.run(seed_cost(model_dir, args.requests, args.tokens))
    results["seed_cost"] = cost
    print("\n| request seeds | step 1 same (two fresh runs) | step 3 same, resumed vs whole | step 3 first turn same |")
    print("|---|---|---|---|")
    for seeds in (False, True):
        r = results[f"request_seeds={seeds}"]
        print(f"| {'on' if seeds else 'off'} | {r['step1_same']:.1%} | {r['step3_same']:.1%} | "
              f"{r['step3_first_turn_same']:.1%} |  ({r['trajectories']:.0f} trajectories a step)")
    print(f"\ngeneration, {args.requests} requests x {args.tokens} tokens: seeds off {cost['off']:,.0f} tokens/s, "
          f"on {cost['on']:,.0f} tokens/s: {cost['on'] / cost['off']:.2f}x")
    if args.out:
        Path(args.out, "bench_resume_gpu.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
