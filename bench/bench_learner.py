"""Learner throughput, MFU and memory: our packed FSDP2 step against a padded transformers loop.

Run from the repository root, one process per GPU:

    torchrun --nproc-per-node 1 -m bench.bench_learner --out $OUT/bench_learner_1gpu.md
    torchrun --nproc-per-node 2 -m bench.bench_learner --out $OUT/bench_learner_2gpu.md
    python -m bench.bench_learner --tiny          # CPU, a tiny model: checks the whole script end to end

It measures (1) the dense bf16 peak with an 8192^3 matmul, the denominator of MFU = 6 * params * tokens /
time / peak; (2) `PolicyWorker.train_step` (agentrl/learner/policy.py) on a random-weight model of the
Qwen2.5-1.5B shape for each variant (VARIANTS: eager, compiled, keeping logits, one FSDP unit) and workload
(4,096-token rows; RL-like sequences packed into 4k and 8k micro-batches); (3) on the same RL-like
sequences, a plain transformers loop that pads each micro-batch of rows to its longest (1 GPU only);
(4) peak memory as micro-batches grow, with the logprob head chunked and in one chunk. Each row is printed
as soon as it is measured; the markdown tables are printed (and written to --out) at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from agentrl.algo import AlgoConfig
from agentrl.engine.random_model import SHAPES
from agentrl.learner import fsdp
from agentrl.learner.attention import KERNELS, packed_backend
from agentrl.learner.config import LearnerConfig, OptimConfig
from agentrl.learner.fsdp import init_distributed
from agentrl.learner.packing import Batch, pack, response_layout
from agentrl.learner.policy import PolicyWorker
from agentrl.types import Prompt, RewardResult, Segment, StopReason, Trajectory

QWEN25_15B = SHAPES["qwen2.5-1.5b"] | dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                                          rms_norm_eps=1e-6)
TINY = SHAPES["tiny"] | dict(vocab_size=2048, max_position_embeddings=4096)
# name: (torch.compile, activation checkpointing, keep logits for backward, FSDP unit, reshard after forward)
VARIANTS = {"eager": (False, False, False, "block", False), "compiled": (True, False, False, "block", False),
            "compiled_keep": (True, False, True, "block", False), "compiled_ac": (True, True, False, "block", False),
            "eager_ac": (False, True, False, "block", False),
            "compiled_root": (True, False, True, "model", False),  # one FSDP unit: no per-block FSDP hooks
            # the same, its weights freed after each forward and gathered again for backward
            "compiled_root_reshard": (True, False, True, "model", True)}


@dataclass
class Setup:
    tiny: bool
    world: int
    rank: int
    device: torch.device
    peak_flops: float = 0.0
    n_params: int = 0
    lengths: tuple[tuple[int, int], tuple[int, int]] | None = None  # --rl-lengths: prompt and response ranges
    rows: list[str] = field(default_factory=list)
    rl_rows: list[str] = field(default_factory=list)
    mem_rows: list[str] = field(default_factory=list)
    raw: list[dict] = field(default_factory=list)

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    @property
    def row_len(self) -> int:
        return 256 if self.tiny else 4096

    def rl_lengths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        if self.lengths is not None:
            return self.lengths
        return ((10, 40), (10, 300)) if self.tiny else ((100, 400), (100, 3000))


def sync(setup: Setup) -> None:
    if setup.device.type == "cuda":
        torch.cuda.synchronize()


def measure_peak(setup: Setup) -> tuple[float, float]:
    """Dense matmul FLOP/s: bf16 8192^3 on GPU (fp32 512^3 on CPU, only to exercise the code), over random
    data. -> (burst: the first 10 matmuls after a warm-up, sustained: at least a second). Under the power
    limit random-data matmuls slow down within a second, so the sustained figure is the lower one. MFU
    divides by the burst figure, the larger, which gives the lower MFU."""
    n, dtype = (512, torch.float32) if setup.device.type == "cpu" else (8192, torch.bfloat16)
    a = torch.randn(n, n, device=setup.device, dtype=dtype)
    b = torch.randn(n, n, device=setup.device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(setup)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(setup)
    burst = 10 * 2 * n**3 / (time.perf_counter() - start)
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < 1.0 or count < 10:  # at least a second: clocks settle
        for _ in range(10):
            a @ b
        count += 10
        sync(setup)
    return burst, count * 2 * n**3 / elapsed


def trajectory(rng: random.Random, vocab: int, prompt_len: int, response_len: int) -> Trajectory:
    prompt = Prompt("p", "", tuple(rng.randrange(vocab) for _ in range(prompt_len)), "", "")
    ids = [rng.randrange(vocab) for _ in range(response_len)]
    return Trajectory(prompt, [Segment("model", ids, [-1.0] * response_len)], StopReason.EOS,
                      reward=RewardResult(float(rng.random() < 0.5)))


def rl_set(setup: Setup, per_gpu: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    (p0, p1), (r0, r1) = setup.rl_lengths()
    vocab = (TINY if setup.tiny else QWEN25_15B)["vocab_size"]
    return [trajectory(rng, vocab, rng.randint(p0, p1), rng.randint(r0, r1)) for _ in range(per_gpu * setup.world)]


def row_set(setup: Setup, per_gpu: int, length: int) -> list[Trajectory]:
    rng = random.Random(1)
    vocab = (TINY if setup.tiny else QWEN25_15B)["vocab_size"]
    return [trajectory(rng, vocab, length // 16, length - length // 16) for _ in range(per_gpu * setup.world)]


def my_batch(setup: Setup, trajs: list[Trajectory], budget: int) -> Batch:
    batch = pack(trajs, budget, setup.world)[setup.rank]
    rng = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (len(trajs), 1), generator=rng).float() * 2 - 1
    batch.set("advantages", sign * response_layout(trajs).mask_BR)
    return batch


def build_model(setup: Setup, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(**(TINY if setup.tiny else QWEN25_15B))
    with torch.device(setup.device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)


def timed(setup: Setup, step: Callable[[], object], warmup: int, steps: int,
          skip_guards: bool = False) -> tuple[float, float]:
    """(seconds per step, peak GiB allocated on this rank) over `steps` after `warmup`. `skip_guards` times the
    steps without dynamo's guard checks (the warm-up compiled every shape these steps see): what the checks
    cost the host, a measurement only."""
    for _ in range(warmup):
        step()
    sync(setup)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards):
        for _ in range(steps):
            step()
        sync(setup)
    seconds = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device.type == "cuda" else float("nan")
    return seconds, peak


def free_memory(setup: Setup) -> None:
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()


def mfu(setup: Setup, tokens_per_gpu: float, seconds: float) -> float:
    return 6 * setup.n_params * tokens_per_gpu / seconds / setup.peak_flops


def bench_variant(setup: Setup, name: str, args: argparse.Namespace) -> dict[str, float]:
    compiled, ac, keep, unit, reshard = VARIANTS[name]
    config = LearnerConfig(compile=compiled, activation_checkpointing=ac, logprob_keep_logits=keep, fsdp_unit=unit,
                           reshard_after_forward=reshard, logprob_chunk_tokens=args.chunk, optim=OptimConfig(lr=1e-6),
                           attention_kernel=args.attention)
    worker = PolicyWorker(config, AlgoConfig(), model=build_model(setup))
    warmup = 2 if compiled else 1
    rl_rates: dict[int, float] = {}  # budget -> useful tokens/s
    workloads = [(f"{setup.row_len}-token rows, one per micro-batch", row_set(setup, args.rows_per_step, setup.row_len),
                  setup.row_len, False)]
    for budget in args.budgets:
        workloads.append((f"RL lengths packed into {budget}-token micro-batches", rl_set(setup, args.rl_per_gpu),
                          budget, True))
    for (label, trajs, budget, is_rl), skip in ((w, skip) for w in workloads
                                                for skip in ((False, True) if args.skip_guard_eval else (False,))):
        batch = my_batch(setup, trajs, budget)
        tokens = float(batch.num_tokens)  # this rank's; ranks are balanced
        shown = f"{name} (guards skipped)" if skip else name
        try:  # the guard-skipping row reuses the row before it's warm-up: same batch, every shape compiled
            seconds, peak = timed(setup, lambda b=batch: worker.train_step(b), 0 if skip else warmup, args.steps, skip)
        except torch.OutOfMemoryError:
            setup.rows.append(f"| {shown} | {label} | {len(batch.micro_batches)} | {int(tokens)} | OOM | | | |")
            torch.cuda.empty_cache()
            continue
        total = sum(len(t.prompt.token_ids) + len(t.response_ids) for t in trajs)
        row = (f"| {shown} | {label} | {len(batch.micro_batches)} | {int(tokens)} | {seconds:.3f} | "
               f"{total / seconds:,.0f} | {mfu(setup, tokens, seconds):.1%} | {peak:.1f} |")
        setup.rows.append(row)
        setup.log(row)
        setup.raw.append({"variant": shown, "workload": label, "seconds": seconds, "tokens_all_gpus": total,
                          "mfu": mfu(setup, tokens, seconds), "peak_gib": peak})
        if is_rl and not skip:
            rl_rates[budget] = total / seconds
        if args.ab_accumulation and worker.grad_accumulation is not None and not skip:
            ab_accumulation(setup, worker, batch, args.steps, f"| {{}} | {label} | {len(batch.micro_batches)} | "
                            f"{int(tokens)} | {{:.3f}} | {{:,.0f}} | {{:.1%}} | {peak:.1f} |", total, tokens, name)
    if args.profile:  # last in the process (main allows it with one variant and no baseline only)
        profile(setup, lambda b=my_batch(setup, workloads[-1][1], workloads[-1][2]): worker.train_step(b))
    if name == args.memory_variant:
        memory_sweep(setup, worker, args)
    return rl_rates  # the worker is freed with this frame (free_memory)


def ab_accumulation(setup: Setup, worker: PolicyWorker, batch: Batch, rounds: int, row: str, total: int,
                    tokens: float, name: str) -> None:
    """Float32 gradient accumulation by FSDP (per parameter) against the fused pass, in this process on this
    batch, step by step in alternation (`rounds` steps each), so a difference between processes or
    machines cannot enter the ratio. Every step is timed alone, between two device syncs; the rows give each
    arm's median step, which a one-off stalled step does not move."""
    fused = worker.grad_accumulation
    arms = {"FSDP accumulation": None, "fused accumulation": fused}
    worker.grad_accumulation = None
    worker.train_step(batch)  # the FSDP path's first step in this process, untimed
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm, accumulation in arms.items():
            worker.grad_accumulation = accumulation
            sync(setup)
            start = time.perf_counter()
            worker.train_step(batch)
            sync(setup)
            times[arm].append(time.perf_counter() - start)
    worker.grad_accumulation = fused
    medians = {arm: statistics.median(ts) for arm, ts in times.items()}
    for arm, seconds in medians.items():
        line = row.format(f"{name} ({arm}, interleaved, median)", seconds, total / seconds, mfu(setup, tokens, seconds))
        setup.rows.append(line)
        setup.log(line)
        setup.raw.append({"variant": f"{name} ({arm}, interleaved, median)", "seconds": seconds, "steps": times[arm],
                          "tokens_all_gpus": total, "mfu": mfu(setup, tokens, seconds)})
    (base, new), (base_mid, new_mid) = [sum(times[a]) for a in arms], list(medians.values())
    setup.log(f"fused / FSDP accumulation: {base / new:.3f}x by mean, {base_mid / new_mid:.3f}x by median "
              f"({rounds} interleaved steps each; the median is blind to a one-off stalled step)")


def memory_sweep(setup: Setup, worker: PolicyWorker, args: argparse.Namespace) -> None:
    """Peak memory per micro-batch size: the head chunked (--chunk tokens) vs one chunk per micro-batch."""
    sizes = [128, 256, 512] if setup.tiny else [2048, 4096, 8192, 16384]
    for size in sizes:
        batch = my_batch(setup, row_set(setup, 2, size), size)
        cells = []
        for chunk in (args.chunk, size):
            worker.module.chunk_tokens = chunk
            gc.collect()
            static = torch.cuda.memory_allocated() / 2**30 if setup.device.type == "cuda" else float("nan")
            try:
                seconds, peak = timed(setup, lambda b=batch: worker.train_step(b), 1, 2)
                cells.append((static, peak, batch.num_tokens / seconds))
            except torch.OutOfMemoryError:
                cells.append((static, float("nan"), float("nan")))
                torch.cuda.empty_cache()
        row = (f"| {size} | {cells[0][0]:.1f} | {cells[0][1]:.1f} | {cells[1][1]:.1f} | {cells[0][2]:,.0f} |")
        setup.mem_rows.append(row)
        setup.log(row)
    worker.module.chunk_tokens = args.chunk


def padded_baseline(setup: Setup, trajs: list[Trajectory], rows: int, steps: int) -> tuple[float, float, float]:
    """A plain transformers step: bf16 weights, SDPA, `rows` sequences right-padded to the longest per
    micro-batch, HF's label loss, gradient accumulation, fused AdamW. -> (useful tokens/s, padding, peak GiB)."""
    lm = build_model(setup, torch.bfloat16 if setup.device.type == "cuda" else torch.float32)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-6, fused=setup.device.type == "cuda")
    micro = []
    for i in range(0, len(trajs), rows):
        group = trajs[i : i + rows]
        seqs = [list(t.prompt.token_ids) + t.response_ids for t in group]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for b, (t, s) in enumerate(zip(group, seqs, strict=True)):
            ids[b, : len(s)] = torch.tensor(s)
            attn[b, : len(s)] = 1
            labels[b, len(t.prompt.token_ids) : len(s)] = torch.tensor(t.response_ids)
        micro.append((ids.to(setup.device), attn.to(setup.device), labels.to(setup.device)))

    def step() -> None:
        for ids, attn, labels in micro:
            (lm(input_ids=ids, attention_mask=attn, labels=labels).loss / len(micro)).backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, peak = timed(setup, step, 1, steps)
    useful = sum(len(t.prompt.token_ids) + len(t.response_ids) for t in trajs)
    padded = sum(ids.numel() for ids, _, _ in micro)
    return useful / seconds, 1 - useful / padded, peak


def profile(setup: Setup, step: Callable[[], object]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
    start = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        step()
        sync(setup)
    wall = time.perf_counter() - start
    key = "self_device_time_total" if setup.device.type == "cuda" else "self_cpu_time_total"
    setup.log(prof.key_averages().table(sort_by=key, row_limit=40))
    setup.log(f"profiled step wall time: {wall * 1e3:.1f} ms")
    if setup.device.type == "cuda":
        trace = "/tmp/agentrl_learner_trace.json"
        prof.export_chrome_trace(trace)
        setup.log(gpu_idle_by_phase(trace))


def gpu_idle_by_phase(trace_path: str) -> str:
    """From a chrome trace: per `agentrl.*` phase (record_function ranges in worker.py), its CPU time and
    how much of it the GPU spent with no kernel or copy running."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy: list[list[float]] = []
    for a, b in gpu:  # union of GPU activity
        if busy and a <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], b)
        else:
            busy.append([a, b])

    def busy_within(a: float, b: float) -> float:
        return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy if y > a and x < b)

    phases: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("agentrl."):
            span = phases.setdefault(e["name"], [0.0, 0.0, 0])
            span[0] += e["dur"]
            span[1] += e["dur"] - busy_within(e["ts"], e["ts"] + e["dur"])
            span[2] += 1
    lines = ["| phase | calls | CPU ms | GPU idle ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v[2]} | {v[0] / 1e3:.1f} | {v[1] / 1e3:.1f} |" for k, v in sorted(phases.items())]
    # where each phase's CPU time goes: the outermost CPU ops (and annotations) inside it, by total time
    cpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation",
                                                                               "python_function")),
                 key=lambda e: (e["ts"], -e["dur"]))
    for phase in sorted(phases):
        ranges = [(e["ts"], e["ts"] + e["dur"]) for e in cpu if e["name"] == phase]
        top: dict[str, float] = {}
        for a, b in ranges:
            end = a
            for e in cpu:
                if e["ts"] >= a and e["ts"] + e["dur"] <= b and e["name"] != phase and e["ts"] >= end:
                    top[e["name"]] = top.get(e["name"], 0.0) + e["dur"]
                    end = e["ts"] + e["dur"]
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:12]
        lines.append(f"{phase} top-level CPU: " + "; ".join(f"{k[:70]} {v / 1e3:.1f}" for k, v in ranked))
    total = busy[-1][1] - busy[0][0] if busy else 0.0
    lines.append(f"GPU busy {sum(b - a for a, b in busy) / 1e3:.1f} ms of {total / 1e3:.1f} ms from first to last kernel")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (or GPU): end-to-end check")
    parser.add_argument("--variants", default=None, help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--budgets", default=None, help="comma list of packed micro-batch token budgets")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per measurement")
    parser.add_argument("--rows-per-step", type=int, default=8, help="full rows (micro-batches) per step")
    parser.add_argument("--rl-per-gpu", type=int, default=48, help="RL-like trajectories per GPU per step")
    parser.add_argument("--rl-lengths", default=None, metavar="P0:P1:R0:R1",
                        help="RL-like lengths: prompt U[P0, P1] and response U[R0, R1] tokens (default 100:400:100:3000; "
                             "a training step's own, e.g. bench_trainer's ToRL steps, are about 40:60:1024:1024)")
    parser.add_argument("--padded-rows", default="2,4", help="rows per padded micro-batch of the baseline")
    parser.add_argument("--chunk", type=int, default=2048, help="logprob chunk tokens")
    parser.add_argument("--memory-variant", default="compiled", help="variant whose worker runs the memory sweep")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--attention", default="flash2", choices=sorted(KERNELS), help="packed attention kernel")
    parser.add_argument("--python-wrapper", action="store_true", help="compile the blocks with inductor's Python "
                        "wrapper instead of the C++ one the learner uses on CUDA: the baseline of that choice")
    parser.add_argument("--ab-accumulation", action="store_true", help="after each row, time float32 gradient "
                        "accumulation by FSDP (one kernel per parameter) against the fused pass in alternating steps")
    parser.add_argument("--dynamo", action="append", default=[], metavar="NAME=True|False",
                        help="set a boolean torch._dynamo.config option for this run (repeatable)")
    parser.add_argument("--skip-guard-eval", action="store_true", help="time each workload a second time without "
                        "dynamo's guard checks (same batch, already compiled): what they cost the host; a measurement")
    parser.add_argument("--profile", action="store_true", help="after the timed rows, print a profiler table of the "
                        "variant's last workload, RL lengths at the largest budget (one variant, --no-baseline: "
                        "a profiler run slows what follows)")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--ours", default=None, help="VARIANT:BUDGET compared with the padded loop, named before "
                        "measuring (default: the last variant at the largest budget)")
    args = parser.parse_args()
    for setting in args.dynamo:
        key, _, value = setting.partition("=")
        if not hasattr(torch._dynamo.config, key) or value not in ("True", "False"):
            parser.error(f"--dynamo: expected NAME=True|False with NAME a torch._dynamo.config setting, got {setting!r}")
        setattr(torch._dynamo.config, key, value == "True")
    if args.python_wrapper:  # a measurement switch, not a learner option: the learner has one way to compile
        fsdp.compile_options = lambda device, checkpointed=False: {"cpp_wrapper": False}
    tiny = args.tiny
    args.variants = (args.variants or ("eager,eager_ac" if tiny else "eager,compiled_keep,compiled_root")).split(",")
    args.budgets = [int(b) for b in (args.budgets or ("256,512" if tiny else "4096,8192")).split(",")]
    args.ours = args.ours or f"{args.variants[-1]}:{max(args.budgets)}"
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")
    if args.profile and (len(args.variants) > 1 or not args.no_baseline):
        parser.error("--profile needs one variant and --no-baseline: after a profiler run in the same process "
                     "later measurements run slower (CUPTI stays attached; pytorch/pytorch#144455)")
    if tiny:
        args.chunk = min(args.chunk, 64)
        args.rl_per_gpu = min(args.rl_per_gpu, 12)
        args.steps = min(args.steps, 2)
        if args.memory_variant not in args.variants:
            args.memory_variant = args.variants[-1]

    lengths = None
    if args.rl_lengths is not None:
        try:
            p0, p1, r0, r1 = (int(x) for x in args.rl_lengths.split(":"))
        except ValueError:
            parser.error(f"--rl-lengths: expected P0:P1:R0:R1 (four whole numbers), got {args.rl_lengths!r}")
        if not (1 <= p0 <= p1 and 1 <= r0 <= r1):
            parser.error(f"--rl-lengths: expected 1 <= P0 <= P1 and 1 <= R0 <= R1, got {args.rl_lengths!r}")
        lengths = ((p0, p1), (r0, r1))
    ctx = init_distributed("auto")
    setup = Setup(tiny, ctx.world_size, ctx.rank, ctx.device, lengths=lengths)
    setup.peak_flops, sustained = measure_peak(setup)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM, Qwen2Config

        probe = AutoModelForCausalLM.from_config(Qwen2Config(**(TINY if tiny else QWEN25_15B)))
    setup.n_params = sum(p.numel() for p in probe.parameters())
    import transformers

    device_name = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "CPU"
    header = [
        f"# Learner benchmark: {device_name} x {ctx.world_size}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        "",
        f"- model: {'tiny Qwen2' if tiny else 'Qwen2.5-1.5B shape'}, {setup.n_params:,} parameters (tied embeddings "
        f"counted once), vocabulary {(TINY if tiny else QWEN25_15B)['vocab_size']:,}, random weights",
        f"- peak: {'bf16 8192^3' if ctx.device.type == 'cuda' else 'fp32 512^3'} matmul measured here: "
        f"{setup.peak_flops / 1e12:,.4g} TFLOP/s in a burst of 10 ({sustained / 1e12:,.4g} sustained over a second); "
        "MFU = 6 * params * tokens per GPU / step time / burst peak",
        f"- packed attention: {packed_backend(ctx.device, args.attention)}; logprob chunk {args.chunk} tokens; "
        f"FSDP2, fp32 master weights, {'bf16' if ctx.device.type == 'cuda' else 'fp32'} compute, reshard_after_forward=False (but "
        "in *_reshard variants); "
        "one optimizer step per timed step",
        f"- RL-like lengths: prompt U{list(setup.rl_lengths()[0])}, response U{list(setup.rl_lengths()[1])} tokens, "
        f"{args.rl_per_gpu} trajectories per GPU per step",
        f"- compiled blocks: inductor options {fsdp.compile_options(ctx.device)} (without activation checkpointing); "
        f"dynamo settings: {args.dynamo or 'defaults'}; float32 gradient accumulation fused where one FSDP unit "
        "(fsdp.FusedGradAccumulation)",
    ]
    setup.log("\n".join(header))
    table_head = ("| variant | workload | micro-batches/GPU | tokens/GPU/step | step s | tokens/s (all GPUs) | MFU | "
                  "peak GiB |\n|---|---|---|---|---|---|---|---|")
    setup.log(table_head)
    rl_rates: dict[tuple[str, int], float] = {}
    for name in args.variants:
        try:
            result = bench_variant(setup, name, args)
        except Exception as e:  # keep measuring the other variants; report what failed and why
            msg = f"| {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''} | | | | | | |"
            setup.rows.append(msg)
            setup.log(msg)
            continue
        finally:
            free_memory(setup)
            torch._dynamo.reset()  # the next variant compiles afresh, not on this one's cache entries
        rl_rates |= {(name, budget): rate for budget, rate in result.items()}

    # "ours" is named before measuring (--ours), not the fastest row; eager packed at the same budget is the
    # like-for-like comparison (no compiler on either side)
    ours_variant, ours_budget = args.ours.split(":")
    ours = rl_rates.get((ours_variant, int(ours_budget)))
    eager = rl_rates.get(("eager", int(ours_budget)))
    if setup.world == 1 and not args.no_baseline and ours:
        trajs = rl_set(setup, args.rl_per_gpu)
        for rows in [int(r) for r in args.padded_rows.split(",")]:
            try:
                rate, waste, peak = padded_baseline(setup, trajs, rows, args.steps)
                like = f"{eager / rate:.2f}x" if eager else "-"
                setup.rl_rows.append(f"| transformers, padded, {rows} rows/micro-batch | {rate:,.0f} | {waste:.0%} | "
                                     f"{peak:.1f} | {ours / rate:.2f}x | {like} |")
            except torch.OutOfMemoryError:
                setup.rl_rows.append(f"| transformers, padded, {rows} rows/micro-batch | OOM | | | | |")
            free_memory(setup)
            setup.log(setup.rl_rows[-1])

    report = header + ["", "## Training step", "", table_head, *setup.rows]
    if not ours:
        report += ["", f"(--ours {args.ours} was not measured: no RL comparison)"]
    else:
        report += ["", f"## RL-like lengths, same trajectories: ours ({ours_variant}, packed {ours_budget}-token "
                   f"micro-batches) = {ours:,.0f} useful tokens/s; eager packed: "
                   + (f"{eager:,.0f}" if eager else "not measured"), ""]
        if setup.rl_rows:
            report += ["| loop | useful tokens/s | padding | peak GiB | ours / it | eager packed / it |",
                       "|---|---|---|---|---|---|", *setup.rl_rows]
        else:
            report += ["(padded baseline: not run: " + ("--no-baseline)" if args.no_baseline else "measured on 1 GPU only)")]
    if setup.mem_rows:
        report += ["", f"## Peak memory vs micro-batch size ({args.memory_variant}; one row of that many tokens; "
                   "2 micro-batches per step)", "",
                   f"| micro-batch tokens | static GiB | peak GiB, chunked ({args.chunk}) | peak GiB, one chunk | "
                   "tokens/s (chunked) |", "|---|---|---|---|---|", *setup.mem_rows]
    text = "\n".join(report)
    setup.log("\n" + text)
    if args.out and setup.rank == 0:
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(setup.raw, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
