"""What a vLLM decode step costs against the number of sequences in it, and which per-request option
pays for it, on one engine (GPU).

For each batch size B and each option set, B requests of a ~60-token prompt each generate N tokens
(`ignore_eos`, final output only) at once, then 2N tokens: one decode step takes (t_2N - t_N) / N, which
leaves out what a run pays once (admission, prefill, the last output), and tokens/s is B N / (t_2N - t_N).
Each run is the fastest of `--repeats`. A least-squares
fit `step_ms = fixed + per_seq * B` splits a step into what every step pays (kernels, launches, the
engine loop) and what each sequence in it adds (scheduling, sampling bookkeeping, output processing,
detokenisation). Where `per_seq * B` dominates, a step of few sequences is about proportionally cheaper,
and the straggler tail of a turn-synchronous rollout costs little.

Option sets (cumulative from what engine/vllm.py asks for):
- agentrl:     the sampled token's logprob (flat), a stop string, detokenised output;
- no_stop:     the same without the stop string;
- no_logprobs: neither stop string nor logprobs;
- no_detok:    none of them, and `detokenize=False`.

The fitted costs then predict, with `simulate` (a step-by-step model of the three loops of
bench_rollout.py over the same drawn turn lengths), how the async loop compares with plain generation and
with the turn-synchronous loop; and an ideal engine (every step the same cost, whatever its size) bounds
what any engine could give on that workload.

    python -m bench.bench_engine_steps --tokenizer DIR [--batches 1,8,32,128,256,512 --tokens 256]
    python -m bench.bench_engine_steps --predict-from steps.json --dists lognormal   # the model alone, on a CPU
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

OPTIONS = {
    "agentrl": dict(logprobs=0, flat_logprobs=True, stop=["```output"], include_stop_str_in_output=True),
    "no_stop": dict(logprobs=0, flat_logprobs=True),
    "no_logprobs": dict(),
    "no_detok": dict(detokenize=False),
}


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `y = a + b x` over (x, y) points; returns (a, b)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("a fit needs at least two different batch sizes")
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def step_cost(points: list[tuple[int, float]]) -> Callable[[int], float]:
    """ms per decode step of B sequences, linear between measured (B, ms) points: flat below the smallest B
    measured, extrapolated along the last segment above the largest."""
    pts = sorted(points)

    def cost(b: int) -> float:
        if b <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
            if b <= x1 or (x1, y1) == pts[-1]:
                return y0 + (y1 - y0) * (b - x0) / (x1 - x0)
        raise AssertionError("unreachable")

    return cost


def simulate(lengths: list[list[int]], tool_ms: float, step: Callable[[int], float]) -> dict[str, float]:
    """Seconds each loop of bench_rollout.py takes when a decode step of B sequences costs `step(B)` ms
    (prefill and per-request overheads left out). `lengths[i][k]`: trajectory i's turn k in tokens; a tool
    call of `tool_ms` follows every turn but the last.

    plain:     each trajectory generates its total in one request;
    async:     a trajectory's next turn joins the running batch when its tool call returns;
    turn_sync: turn k of every trajectory, then all tool calls of turn k, then turn k + 1.
    """
    def one_batch(sizes: list[int]) -> float:  # every request starts at once and runs to its length
        ends, t, alive = sorted(sizes), 0.0, len(sizes)
        done = 0
        for s in range(ends[-1] if ends else 0):
            while ends[done] <= s:
                done += 1
            t += step(alive - done)
        return t

    turns = len(lengths[0])
    plain = one_batch([sum(x) for x in lengths])
    turn_sync = sum(one_batch([x[k] for x in lengths]) for k in range(turns)) + (turns - 1) * tool_ms

    left = {i: x[0] for i, x in enumerate(lengths)}  # generating: tokens left in the current turn
    turn, waiting, t = [0] * len(lengths), [], 0.0  # waiting: (tool returns at, trajectory)
    while left or waiting:
        if not left:
            t = max(t, waiting[0][0])
        while waiting and waiting[0][0] <= t:
            i = heapq.heappop(waiting)[1]
            left[i] = lengths[i][turn[i]]
        t += step(len(left))
        for i in list(left):
            left[i] -= 1
            if left[i] == 0:
                del left[i]
                turn[i] += 1
                if turn[i] < turns:
                    heapq.heappush(waiting, (t + tool_ms, i))
    return {"plain": plain / 1e3, "async": t / 1e3, "turn_sync": turn_sync / 1e3}


def predict(points: list[tuple[int, float]], args: argparse.Namespace) -> None:
    """Print the modelled seconds and ratios for each distribution with the measured step costs, and with
    an ideal engine whose every step costs what a full batch does."""
    from bench.bench_rollout import turn_lengths

    measured, full = step_cost(points), step_cost(points)(args.trajectories)
    print(f"\nmodelled rollouts ({args.trajectories} trajectories x {args.turns} turns, mean turn {args.turn_tokens} tokens, "
          f"tool {args.tool_ms:g} ms), step costs (B, ms) {sorted(points)}:\n")
    print("| turn lengths | step cost | plain s | async s | turn_sync s | async vs plain | async vs turn_sync |")
    print("|---|---|---|---|---|---|---|")
    for dist in args.dists.split(","):
        lengths = turn_lengths(args.trajectories, args.turns, args.turn_tokens, dist=dist)
        for label, step in (("measured", measured), (f"ideal: {full:.2f} ms at any B", lambda b: full)):
            r = simulate(lengths, args.tool_ms, step)
            print(f"| {dist} | {label} | {r['plain']:.1f} | {r['async']:.1f} | {r['turn_sync']:.1f} | "
                  f"{r['plain'] / r['async']:.2f} | {r['turn_sync'] / r['async']:.2f} |")


async def run(engine, prompts: list[list[int]], tokens: int, options: dict, tag: str) -> int:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                            **options)

    async def one(i: int, ids: list[int]) -> int:
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, request_id=f"{tag}-{i}"):
            final = out
        return len(final.outputs[0].token_ids)

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (needed unless --predict-from)")
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--batches", default="1,8,32,128,256,512")
    ap.add_argument("--tokens", type=int, default=256, help="N: new tokens per request in the shorter run (the longer: 2N)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per (options, B); the fastest counts")
    ap.add_argument("--options", default=",".join(OPTIONS), help="comma list of: " + ", ".join(OPTIONS))
    ap.add_argument("--model-dir", default="/tmp/agentrl-bench-model")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trajectories", type=int, default=256, help="modelled rollout: as bench_rollout.py")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--tool-ms", type=float, default=100.0)
    ap.add_argument("--dists", default="uniform,lognormal")
    ap.add_argument("--predict-from", default=None,
                    help="no GPU: model rollouts from the step costs in this --json of an earlier run")
    ap.add_argument("--predict-options", default="no_stop",
                    help="the option set whose step costs model rollouts (bench_rollout's requests: no_stop)")
    args = ap.parse_args()
    if args.predict_from:
        rows = json.loads(Path(args.predict_from).read_text())["rows"]
        predict([(r["batch"], r["step_ms"]) for r in rows if r["options"] == args.predict_options], args)
        return
    if args.tokenizer is None:
        raise SystemExit("--tokenizer DIR is needed to measure (or pass --predict-from JSON)")
    batches = [int(x) for x in args.batches.split(",")]
    names = args.options.split(",")
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown option set(s) {unknown}: expected some of {', '.join(OPTIONS)}")

    from transformers import AutoTokenizer

    from agentrl.engine.random_model import write_random_checkpoint
    from agentrl.engine.vllm import VLLMEngine

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    write_random_checkpoint(args.model_dir, tok, args.shape, vocab_size=151936, max_position_embeddings=16384, device="cuda")
    prompts = [tok.encode(f"Question {i}: " + "think about numbers " * 15) for i in range(max(batches))]
    engine = VLLMEngine(args.model_dir, gpu_memory_utilization=0.85, max_model_len=16384, admission_interval_ms=0)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(run(engine.engine, prompts[:32], 32, OPTIONS["agentrl"], "warm"))
    rows = []
    for name in names:
        for b in batches:
            # distinct prompts per run: the prefix cache must not turn a later run's prefill into a hit
            batch = [[len(rows) + 1000, *p] for p in prompts[:b]]
            seconds = {}
            for n in (args.tokens, 2 * args.tokens):
                seconds[n] = math.inf
                for rep in range(args.repeats):  # the fastest of a few: short runs catch host noise
                    t0 = time.perf_counter()
                    generated = loop.run_until_complete(run(engine.engine, [[rep, n, *p] for p in batch], n,
                                                            OPTIONS[name], f"{name}-{b}-{n}-{rep}"))
                    seconds[n] = min(seconds[n], time.perf_counter() - t0)
                    if generated != b * n:  # a random model wrote the stop string: fewer sequences ran to the end
                        print(f"warning: {name}, B={b}: {generated} tokens generated, not {b * n}", flush=True)
            decode_s = seconds[2 * args.tokens] - seconds[args.tokens]
            rows.append({"options": name, "batch": b, "seconds_n": round(seconds[args.tokens], 3),
                         "seconds_2n": round(seconds[2 * args.tokens], 3),
                         "tokens_per_s": round(b * args.tokens / decode_s), "step_ms": round(decode_s / args.tokens * 1e3, 3)})
            print(json.dumps(rows[-1]), flush=True)
    loop.run_until_complete(engine.aclose())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)

    print(f"\nmodel {args.shape} (random weights, vocab 151936), {args.tokens} new tokens per request\n")
    print("| options | " + " | ".join(f"B={b} ms/step (tok/s)" for b in batches) + " | fixed ms/step | per sequence us/step |")
    print("|---|" + "---|" * (len(batches) + 2))
    for name in names:
        mine = [r for r in rows if r["options"] == name]
        a, b = fit([(r["batch"], r["step_ms"]) for r in mine])
        cells = " | ".join(f"{r['step_ms']} ({r['tokens_per_s']:,})" for r in mine)
        print(f"| {name} | {cells} | {a:.2f} | {b * 1e3:.1f} |")
    chosen = args.predict_options if args.predict_options in names else names[0]
    predict([(r["batch"], r["step_ms"]) for r in rows if r["options"] == chosen], args)


if __name__ == "__main__":
    main()
