"""Multi-turn tool rollout throughput on a GPU, three ways in one run on one vLLM engine:

1. plain   - single-turn vLLM generation of the same number of tokens per trajectory (no tools);
2. async   - rollout.py's loop, one asyncio task per trajectory: T turns, each of a length drawn
             uniformly around L (seeded; real turns vary), a tool of fixed latency between turns, whose
             calls overlap the other trajectories' generation;
3. turn_sync - the same trajectories run turn by turn (every trajectory's turn k, then all tool calls
             of turn k), the ToRL / Search-R1 / TRL loop.

A random-weight model never writes a tool call, so `FixedTurns` ends each model turn after its drawn
length as if a stop string had completed, and `BenchFormat` reads every turn end as a call of the
sleeping tool: the engine, the rollout loop, tool overlap and prefix caching are all the real ones.

    python bench/bench_rollout.py --tokenizer DIR [--trajectories 256 --turns 4 --turn-tokens 256 --tool-ms 100]

`--modes` runs a subset of the three (one mode per process, e.g. to profile it alone); `--instances N`
puts N engines on the GPU, each its own engine-core process, trajectories routed among them by session.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.engine import Completion, Sampling, maybe_await
from agentrl.engine.pool import EnginePool
from agentrl.engine.process import ProcessEngine
from agentrl.engine.vllm import VLLMEngine, vllm_processes
from agentrl.rollout import RolloutConfig, rollout
from agentrl.task_spec import Budgets
from agentrl.tools.formats import Calls, ToolFormat
from agentrl.types import Prompt, ToolCall, ToolResult


class BenchFormat(ToolFormat):
    name = "bench"
    stop = ("```output",)  # ToRL's: the engine detokenises and checks a stop string, as in a real rollout

    def parse(self, text, stop):
        return Calls([ToolCall("sleep", {})])

    def render(self, calls, results, turn_text):
        return f"\n<result>{results[0].text}</result>\n"


class SleepTool:
    name = "sleep"

    def __init__(self, seconds: float):
        self.seconds = seconds

    async def call(self, call):
        t0 = time.perf_counter()
        await asyncio.sleep(self.seconds)
        return ToolResult("the answer is 42", latency_s=time.perf_counter() - t0)

    async def aclose(self):
        pass


DISTS = {
    "uniform": "uniform in [mean/8, 2 mean - mean/8]",
    "lognormal": "lognormal, sigma 1, median mean/e^0.5 (so the mean is `mean`), clipped to [16, 8 mean]",
}


def turn_lengths(n: int, turns: int, mean: int, seed: int = 0, dist: str = "uniform") -> list[list[int]]:
    """Per trajectory, per turn, a length drawn from `dist` (DISTS) with mean about `mean`. Reasoning
    models' turns are heavy-tailed (a short tool call, then a long derivation): `lognormal` models that."""
    rng = random.Random(seed)
    if dist == "uniform":
        lo = max(1, mean // 8)
        return [[rng.randint(lo, 2 * mean - lo) for _ in range(turns)] for _ in range(n)]
    if dist == "lognormal":
        mu = math.log(mean) - 0.5  # E[lognormal(mu, 1)] = exp(mu + 1/2) = mean
        return [[min(8 * mean, max(16, round(rng.lognormvariate(mu, 1.0)))) for _ in range(turns)] for _ in range(n)]
    raise ValueError(f"unknown turn-length distribution {dist!r}: expected one of {', '.join(DISTS)}")


class FixedTurns:
    """Passes requests to the engine, each turn cut at its drawn length; a turn that ran to it reads as a
    completed stop."""

    def __init__(self, engine, lengths: dict[str, list[int]]):
        self.engine, self.lengths = engine, {k: list(v) for k, v in lengths.items()}

    async def generate(self, prompt_ids, sampling: Sampling, *, session=None) -> Completion:
        length = self.lengths[session].pop(0)
        c = await self.engine.generate(prompt_ids, sampling.with_(max_tokens=min(length, sampling.max_tokens)), session=session)
        c.finish_reason = "stop"
        return c


class BenchEngine(VLLMEngine):
    """VLLMEngine and what the bench asks of it, callable where the engine lives (in this process or, under
    --engine-processes, through ProcessEngine.call in its own)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lag = FrontendLag(self)  # recorded where the frontend runs, in process mode too

    def set_admission(self, seconds: float, min_in_flight: int) -> None:
        self.admission_interval_s = seconds
        self.admission_min_in_flight = min_in_flight

    def lag_mark(self) -> int:
        return len(self.lag.lags_s)

    def lags_since(self, mark: int) -> list[float]:
        return self.lag.lags_s[mark:]

    def counters(self) -> dict[str, float]:
        """vLLM's COUNTERS as this process's registry holds them (the engine's frontend registers there)."""
        return engine_counters()

    async def plain(self, prompt_ids: list[int], max_tokens: int, request_id: str) -> int:
        """One plain request of `max_tokens` tokens, EOS ignored; with the loops' stop string and logprob
        options, so the frontend does the same work per token. Returns the tokens generated."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, logprobs=0, flat_logprobs=True,
                                stop=list(BenchFormat.stop), include_stop_str_in_output=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=request_id):
            final = out
        return len(final.outputs[0].token_ids)


class Instances(EnginePool):
    """The engines of a run behind one EnginePool (agentrl/engine/pool.py: a trajectory's turns go to one
    engine, by its session key), and what the bench asks of each where it lives. `--engine-processes` puts
    each engine, frontend included, in a process of its own (`vllm_processes`); otherwise all frontends
    share this process's event loop."""

    def __init__(self, engines):
        super().__init__(engines)
        self.in_process = not any(isinstance(e, ProcessEngine) for e in engines)

    async def on(self, engine, method: str, *args):
        """`engine.method(*args)` where the engine lives."""
        if self.in_process:
            return await maybe_await(getattr(engine, method)(*args))
        return await engine.call(method, *args)

    async def on_all(self, method: str, *args) -> list:
        return [await self.on(e, method, *args) for e in self.engines]

    async def counters(self) -> dict[str, float]:
        """vLLM's COUNTERS over all engines: one registry here when they share this process, else each
        engine's process's registry, summed."""
        if self.in_process:
            return engine_counters()
        parts = await self.on_all("counters")
        return {k: sum(p[k] for p in parts) for k in parts[0]}

    async def lags_since(self, marks: list[int]) -> list[float]:
        return [x for e, m in zip(self.engines, marks, strict=True) for x in await self.on(e, "lags_since", m)]


# vLLM's Prometheus metrics (recorded in this process, the engine's frontend): the iteration-tokens
# histogram gets one sample per engine step, so its count is the number of steps a mode took. (With
# --instances above 1 each new engine re-registers the metrics: only the last engine's are counted.)
COUNTERS = {"vllm:iteration_tokens_total_count": "steps", "vllm:iteration_tokens_total_sum": "step_tokens",
            "vllm:num_preemptions_total": "preemptions", "vllm:prompt_tokens_total": "prompt_tokens",
            "vllm:prompt_tokens_cached_total": "cached_prompt_tokens"}


def sum_samples(metrics) -> dict[str, float]:
    """Totals of COUNTERS over Prometheus metric families (all engines, all label values)."""
    out = dict.fromkeys(COUNTERS.values(), 0.0)
    for metric in metrics:
        for sample in metric.samples:
            if sample.name in COUNTERS:
                out[COUNTERS[sample.name]] += sample.value
    return out


def engine_counters() -> dict[str, float]:
    from prometheus_client import REGISTRY

    return sum_samples(REGISTRY.collect())


GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}


async def sample_gauges(gauges: dict[str, object], out: dict[str, list[float]], every_s: float = 0.025) -> None:
    """Until cancelled, every `every_s` append each gauge's value, summed over its label values (engines), to
    `out[name]`. Over a mode, the means of vLLM's running and waiting counts (GAUGES, set once per engine
    step, in the frontend's stats record, so they lag with it) say how full its decode batches were. With
    --instances above 1 in one process only the last engine's gauges exist (vLLM re-registers them)."""
    while True:
        for name, gauge in gauges.items():
            out.setdefault(name, []).append(sum(s.value for m in gauge.collect() for s in m.samples))
        await asyncio.sleep(every_s)


class FrontendLag:
    """How far vLLM's frontend (the output handler on this process's event loop) runs behind its engine core:
    for each chunk of an engine-output batch it processes (up to VLLM_V1_OUTPUT_PROC_CHUNK_SIZE requests; a
    later chunk's lag includes the earlier chunks' processing), the time since the engine core stamped the
    batch (both CLOCK_MONOTONIC, one machine). A lag delays every turn's end, and so the next turn's start, in the loops;
    plain generation only waits for it once. Wraps the engine's `output_processor.process_outputs`."""

    def __init__(self, engine):
        self.lags_s: list[float] = []
        processor = engine.engine.output_processor
        original = processor.process_outputs

        def process_outputs(outputs, timestamp=None, *rest, **kw):
            if timestamp:
                self.lags_s.append(time.monotonic() - timestamp)
            return original(outputs, timestamp, *rest, **kw)

        processor.process_outputs = process_outputs


def lag_summary(lags_s: list[float]) -> dict[str, float]:
    """Mean, p90 and max (ms) of lags in seconds; {} for none."""
    lags = sorted(lags_s)
    if not lags:
        return {}
    return {"lag_ms_mean": round(1000 * statistics.fmean(lags), 1), "lag_ms_p90": round(1000 * lags[int(0.9 * (len(lags) - 1))], 1),
            "lag_ms_max": round(1000 * lags[-1], 1)}


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) so far of this process (the frontend: rollout loop, vLLM's output handler)
    and of its child processes (the engine core)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            children += c.user + c.system
        except psutil.NoSuchProcess:
            pass
    return t.user + t.system, children


async def observed(coro, seconds_out: list[float], gauges: dict[str, list[float]]):
    """Run `coro` while sampling vLLM's GAUGES into `gauges`; its wall seconds go to `seconds_out`."""
    from prometheus_client import REGISTRY

    found = {short: REGISTRY._names_to_collectors[name] for name, short in GAUGES.items()  # noqa: SLF001
             if name in REGISTRY._names_to_collectors}  # noqa: SLF001 - reading one gauge, not a full collect()
    sampler = asyncio.create_task(sample_gauges(found, gauges))
    t0 = time.perf_counter()
    try:
        return await coro
    finally:
        seconds_out.append(time.perf_counter() - t0)
        sampler.cancel()


def step_stats(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """What one mode cost the engine: steps, tokens per step, ms per step, preemptions, cached prompt share.
    Tells a mode that ran more steps from one whose steps ran slower."""
    d = {k: after[k] - before[k] for k in after}
    steps = d["steps"] or float("nan")
    return {"steps": int(d["steps"]), "tokens_per_step": round(d["step_tokens"] / steps, 1),
            "ms_per_step": round(1000 * seconds / steps, 2), "preemptions": int(d["preemptions"]),
            "cached_prompt_share": round(d["cached_prompt_tokens"] / d["prompt_tokens"], 3) if d["prompt_tokens"] else 0.0}


async def run_plain(engine: Instances, prompts, tokens: list[int]) -> int:
    """Each prompt generates its trajectory's total of model tokens in one request (BenchEngine.plain)."""
    done = await asyncio.gather(*(engine.on(engine.pick(f"{p.id}/0"), "plain", list(p.token_ids), tokens[i], f"plain-{i}")
                                  for i, p in enumerate(prompts)))
    return sum(done)


async def run_loop(engine, prompts, tok, args, mode: str, lengths: list[list[int]]) -> tuple[int, dict]:
    longest = max(max(x) for x in lengths)  # no budget cuts a drawn turn short
    budgets = Budgets(max_turns=args.turns, max_tool_calls=args.turns - 1, max_tokens_per_turn=longest,
                      max_response_tokens=args.turns * (longest + 64))
    per_session = {f"{p.id}/0": lengths[i] for i, p in enumerate(prompts)}
    groups = await rollout(prompts, engine=FixedTurns(engine, per_session), fmt=BenchFormat(), tools={"sleep": SleepTool(args.tool_ms / 1000)},
                           budgets=budgets, tokenizer=tok, config=RolloutConfig(n=1, mode=mode, seed=1))
    trajectories = [t for g in groups for t in g.trajectories]
    generated = sum(sum(s.token_ids.__len__() for s in t.segments if s.source == "model") for t in trajectories)
    turns = sum(t.num_turns for t in trajectories) / len(trajectories)
    # the trajectory that took longest: how its time split between the engine (generate_s, which includes the
    # admission wait) and its tool calls (for turn_sync this leaves out the waits at each turn's barrier, so
    # it need not be the trajectory that finished last)
    slowest = max(trajectories, key=lambda t: t.timings["generate_s"] + t.timings["tool_s"])
    return generated, {"turns_mean": turns, "slowest_generate_s": round(slowest.timings["generate_s"], 2),
                       "slowest_tool_s": round(slowest.timings["tool_s"], 2),
                       "slowest_tokens": sum(len(s.token_ids) for s in slowest.segments if s.source == "model")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--trajectories", type=int, default=256)  # ToRL's step: 32 prompts x 8 samples
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=256)
    ap.add_argument("--tool-ms", type=float, default=100.0)
    ap.add_argument("--dists", default="uniform,lognormal", help="turn-length distributions: " + ", ".join(DISTS))
    ap.add_argument("--admission-ms", default="200@32", help="comma list: the async loop once per VLLMEngine "
                    "admission setting, MS@N: waves every MS ms while N other requests are in flight on an engine "
                    "(200@32: the engine's default); MS alone: waves whatever is in flight; 0: no waves")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the modes this many times, interleaved (plain, async, turn_sync, plain, ...); the table "
                         "gives the median rate and the median and range of the per-repeat ratios")
    ap.add_argument("--cudagraph-modes", default="default",
                    help="comma list: one engine per vLLM cudagraph_mode, each in its own process (default = vLLM's "
                         "FULL_AND_PIECEWISE: full graphs for pure-decode steps only; FULL = for mixed steps too)")
    ap.add_argument("--modes", default="plain,async,turn_sync", help="comma list: which of the three loops run")
    ap.add_argument("--instances", type=int, default=1,
                    help="engines sharing the GPU (each its own engine-core process), trajectories routed by session")
    ap.add_argument("--engine-processes", action="store_true",
                    help="each engine in a process of its own (engine/process.py), its frontend off this event loop "
                         "(no running/waiting gauges then; 'this process' CPU is the rollout loop's alone)")
    ap.add_argument("--no-engine-stats", action="store_true",
                    help="VLLMEngine(log_stats=False): vLLM's per-step stats off in its frontend; no engine counters")
    ap.add_argument("--model-dir", default="/tmp/agentrl-bench-model")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    unknown = set(args.modes.split(",")) - {"plain", "async", "turn_sync"}
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; expected some of plain, async, turn_sync")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.instances < 1:
        raise SystemExit(f"--instances must be at least 1, got {args.instances}")
    try:
        [admission(x) for x in args.admission_ms.split(",")]  # before any engine starts
    except ValueError as e:
        raise SystemExit(str(e)) from None
    modes = args.cudagraph_modes.split(",")
    if len(modes) == 1:
        rows, start = measure(args, modes[0])
        start_s = {modes[0]: start}
    else:  # each engine in a process of its own: a second engine in one process ran slower in every mode
        rows, start_s = [], {}
        for mode in modes:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "rows.json"
                flags = [x for k, v in vars(args).items() if k not in ("cudagraph_modes", "json") and v is not False
                         for x in ((f"--{k.replace('_', '-')}",) if v is True else (f"--{k.replace('_', '-')}", str(v)))]
                subprocess.run([sys.executable, __file__, *flags, "--cudagraph-modes", mode, "--json", str(out)],
                               check=True)
                done = json.loads(out.read_text())
            rows += done["rows"]
            start_s |= done["engine_start_s"]
    report(args, rows, start_s)


def measure(args: argparse.Namespace, graphs: str) -> tuple[list[dict], float]:
    """Plain, async (once per admission interval) and turn-synchronous rollouts on one engine; and the
    engine's start-up seconds."""
    from transformers import AutoTokenizer

    from agentrl.engine.random_model import write_random_checkpoint

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    write_random_checkpoint(args.model_dir, tok, args.shape, vocab_size=151936, max_position_embeddings=16384, device="cuda")
    prompts = []
    for i in range(args.trajectories):
        ids = tok.encode(f"Question {i}: " + "think about numbers " * (20 + i % 40))
        prompts.append(Prompt(str(i), "", tuple(ids), "", ""))
    t0 = time.perf_counter()
    kwargs = {} if graphs == "default" else {"compilation_config": {"cudagraph_mode": graphs}}
    kwargs |= dict(max_model_len=16384, log_stats=not args.no_engine_stats)
    if args.engine_processes:
        engine = Instances(vllm_processes(args.model_dir, args.instances, factory=BenchEngine, **kwargs).engines)
    else:  # one after another: each sizes its cache from free memory
        engine = Instances([BenchEngine(model=args.model_dir, gpu_memory_utilization=0.85 / args.instances, **kwargs)
                            for _ in range(args.instances)])
    start_s = round(time.perf_counter() - t0, 1)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(run_plain(engine, prompts[:32], [32] * 32))  # warm-up: compile, graphs, allocator
    rows = []
    for dist in args.dists.split(","):
        lengths = turn_lengths(len(prompts), args.turns, args.turn_tokens, dist=dist)
        waves = args.admission_ms.split(",")
        modes = args.modes.split(",")
        for repeat, (name, wave) in ((r, x) for r in range(args.repeats) for x in schedule(modes, waves, r)):
            wave_ms, min_in_flight = admission(wave)
            loop.run_until_complete(engine.on_all("set_admission", wave_ms / 1000, min_in_flight))
            # no mode starts with the prompts an earlier mode left in the prefix cache
            loop.run_until_complete(engine.on_all("reset_prefix_cache"))
            before = loop.run_until_complete(engine.counters())
            cpu_before, marks = cpu_seconds(), loop.run_until_complete(engine.on_all("lag_mark"))
            gauges: dict[str, list[float]] = {}
            timing: list[float] = []
            if name == "plain":
                run = run_plain(engine, prompts, [sum(x) for x in lengths])
            else:
                run = run_loop(engine, prompts, tok, args, name, lengths)
            result = loop.run_until_complete(observed(run, timing, gauges))
            generated, extra = (result, {}) if name == "plain" else result
            seconds = timing[0]
            if not args.no_engine_stats:
                extra |= step_stats(before, loop.run_until_complete(engine.counters()), seconds)
            cpu_after = cpu_seconds()
            extra |= {"frontend_cpu_share": round((cpu_after[0] - cpu_before[0]) / seconds, 2),
                      "child_cpu_share": round((cpu_after[1] - cpu_before[1]) / seconds, 2)}
            extra |= {f"mean_{k}": round(statistics.fmean(v), 1) for k, v in gauges.items() if v}
            extra |= lag_summary(loop.run_until_complete(engine.lags_since(marks)))
            label = name if name != "async" else f"{name} (admission {wave_ms:g} ms" + (
                f", waves from {min_in_flight} in flight)" if min_in_flight else ")")
            rows.append({"graphs": graphs, "dist": dist, "mode": label, "repeat": repeat, "generated_tokens": generated,
                         "seconds": round(seconds, 2), "tokens_per_s": round(generated / seconds), **extra})
            print(json.dumps(rows[-1]), flush=True)  # partial results survive a timeout
    loop.run_until_complete(engine.aclose())
    return rows, start_s


def admission(setting: str) -> tuple[float, int]:
    """An --admission-ms entry, MS or MS@N: (wave interval ms, requests in flight from which waves apply)."""
    ms, _, min_in_flight = setting.partition("@")
    try:
        return float(ms), int(min_in_flight or 0)
    except ValueError:
        raise ValueError(f"--admission-ms: {setting!r} is not MS or MS@N (e.g. 200 or 200@32)") from None


def schedule(modes: list[str], waves: list[str], repeat: int) -> list[tuple[str, str]]:
    """(mode, admission ms) in the order repeat `repeat` runs them: plain, async once per admission setting,
    turn_sync; the admission settings rotate from repeat to repeat, so none always runs first."""
    k = repeat % len(waves)
    turned = waves[k:] + waves[:k]
    return [(m, w) for m in ("plain", "async", "turn_sync") if m in modes for w in (turned if m == "async" else ["0"])]


def groups(rows: list[dict]) -> dict[tuple[str, str, str], list[dict]]:
    """Rows by (cudagraph mode, turn lengths, mode), repeats in run order."""
    out: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["graphs"], r["dist"], r["mode"]), []).append(r)
    return out


def lag_cell(row: dict) -> str:
    return f"{row.get('lag_ms_mean', '-')} / {row.get('lag_ms_p90', '-')}"


def report(args: argparse.Namespace, rows: list[dict], start_s: dict[str, float]) -> None:
    print(f"\nmodel {args.shape} (random weights, vocab 151936), {args.instances} engine(s), {args.trajectories} trajectories x {args.turns} turns, "
          f"mean turn length {args.turn_tokens} tokens, tool latency {args.tool_ms:g} ms, engine start (s) {start_s}")
    for dist in args.dists.split(","):
        print(f"- {dist}: {DISTS[dist]}")
    print("\n| cudagraph mode | turn lengths | mode | generated tokens | seconds (median) | tokens/s (median) | each repeat "
          "(tokens/s) | engine steps (each) | ms per step (each) | running requests, mean (each) | this process's CPU share (each) "
          "| frontend lag ms, mean / p90 (each) | vs plain | vs turn_sync |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    grouped = groups(rows)
    for key, runs in grouped.items():
        graphs, dist, mode = key
        rates = [r["tokens_per_s"] for r in runs]
        cells = []
        for base in ("plain", "turn_sync"):
            by_repeat = {r["repeat"]: r["tokens_per_s"] for r in grouped.get((graphs, dist, base), [])}
            ratios = sorted(r["tokens_per_s"] / by_repeat[r["repeat"]] for r in runs if r["repeat"] in by_repeat)
            cells.append("-" if not ratios else f"{statistics.median(ratios):.2f}" if len(ratios) == 1 else
                         f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"| {graphs} | {dist} | {mode} | {runs[0]['generated_tokens']} | {statistics.median(r['seconds'] for r in runs)} | "
              f"{statistics.median(rates):,.0f} | {', '.join(f'{x:,}' for x in rates)} | "
              f"{', '.join(str(r.get('steps', '-')) for r in runs)} | {', '.join(str(r.get('ms_per_step', '-')) for r in runs)} | "
              f"{', '.join(str(r.get('mean_running', '-')) for r in runs)} | {', '.join(str(r.get('frontend_cpu_share', '-')) for r in runs)} | "
              f"{', '.join(lag_cell(r) for r in runs)} | "
              f"{cells[0]} | {cells[1]} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "engine_start_s": start_s}, f, indent=2)

if __name__ == "__main__":
    main()
