"""Packed causal attention kernels on the learner's micro-batches: time and error of each kernel.

Run from the repository root on a GPU:

    python -m bench.bench_attention [--kernels flash2,fa4] [--json $OUT/attention.json]

For the Qwen2.5-1.5B attention shape (12 query heads, 2 key/value heads, head size 128, bf16) it builds
two workloads as the learner sees them: RL-like sequences (prompt U[100, 400] + response U[100, 3000]
tokens, 48 of them) packed into 4096-token micro-batches by `agentrl.learner.packing.pack`, and 4096-token
rows. For every kernel `agentrl.learner.attention` offers ("flash2": the FlashAttention-2 varlen kernels inside torch, k/v on their own heads;
"fa4": flash-attn-4, where installed) it times forward and forward + backward over all micro-batches
with CUDA events, and checks the output and the q/k/v gradients on the first micro-batch against a float32
per-sequence SDPA reference (relative error of the whole tensor). TFLOP/s counts causal attention work only: forward 4 * heads * head size *
sum(l * (l + 1) / 2), backward 2.5x that.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from agentrl.learner import attention
from agentrl.learner.packing import pack
from bench.bench_learner import QWEN25_15B, trajectory

HEADS, KV_HEADS = QWEN25_15B["num_attention_heads"], QWEN25_15B["num_key_value_heads"]
HEAD_DIM = QWEN25_15B["hidden_size"] // HEADS


def workloads(budget: int, sequences: int, rows: int) -> dict[str, list[torch.Tensor]]:
    """name -> cu_seqlens (int32, CPU) of each micro-batch."""
    rng = random.Random(0)
    trajs = [trajectory(rng, 1000, rng.randint(100, 400), rng.randint(100, 3000)) for _ in range(sequences)]
    batch = pack(trajs, budget, 1)[0]
    rl = [mb.cu_seqlens_S.to(torch.int32) for mb in batch.micro_batches]
    return {f"RL lengths packed into {budget}-token micro-batches": rl,
            f"{budget}-token rows": [torch.tensor([0, budget], dtype=torch.int32)] * rows}


def causal_flops(cus: list[torch.Tensor]) -> float:
    pairs = sum(int(n) * (int(n) + 1) // 2 for cu in cus for n in cu.diff())
    return 4.0 * HEADS * HEAD_DIM * pairs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """Float32 per-sequence causal SDPA, [T, H, D] in and out."""
    out, _ = attention.packed_attention(None, *(x.float().transpose(0, 1)[None] for x in (q, k, v)), None,
                                        scaling=HEAD_DIM ** -0.5, cu_seq_lens_q=cu.to(q.device))
    return out[0]


def check(kernel, cu: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Relative error ||x - ref|| / ||ref|| against the float32 reference, for the output and each gradient
    (a norm over the whole tensor: a max |difference| is set by bf16 rounding of the largest values and
    would hide a kernel that is slightly wrong everywhere)."""
    gen = torch.Generator(device=device).manual_seed(0)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, h, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    g = torch.randn(t, HEADS, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16)
    errors = {}
    results = []
    for fn, dtype in ((kernel, torch.bfloat16), (None, torch.float32)):
        leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
        cu_d = cu.to(device)
        out = (fn(*leaves, cu_d, int(cu.diff().max()), HEAD_DIM ** -0.5) if fn is not None
               else reference(*leaves, cu))
        out.backward(g.to(dtype))
        results.append([out.detach().float(), *(x.grad.float() for x in leaves)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        errors[name] = float((a - b).norm() / b.norm())
    return errors


def time_kernel(kernel, cus: list[torch.Tensor], device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms) over all micro-batches, best of `repeats`."""
    gen = torch.Generator(device=device).manual_seed(1)
    inputs = []
    for cu in cus:
        t = int(cu[-1])
        q, k, v = (torch.randn(t, h, HEAD_DIM, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
                   for h in (HEADS, KV_HEADS, KV_HEADS))
        inputs.append((q, k, v, cu.to(device), int(cu.diff().max()), torch.randn_like(q)))

    def run(backward: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for q, k, v, cu, max_len, g in inputs:
            if backward:  # autograd.grad: nothing accumulates into .grad between calls
                torch.autograd.grad(kernel(q, k, v, cu, max_len, HEAD_DIM ** -0.5), (q, k, v), g)
            else:
                with torch.no_grad():
                    kernel(q, k, v, cu, max_len, HEAD_DIM ** -0.5)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    run(False), run(True)  # warm-up (and, for fa4, its kernels' JIT compilation)
    return min(run(False) for _ in range(repeats)), min(run(True) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="flash2,fa4", help="of " + ", ".join(attention.KERNELS))
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the kernels it compares are GPU kernels")
    device = torch.device("cuda")
    loads = workloads(args.budget, args.sequences, args.rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; heads {HEADS}/{KV_HEADS}, head size "
          f"{HEAD_DIM}, bf16")
    rows, raw = [], []
    for name in args.kernels.split(","):
        kernel = attention._resolve_varlen(name)
        if kernel is None:
            print(f"{name}: not installed, skipped")
            continue
        errors = check(kernel, loads[next(iter(loads))][0], device)
        for load, cus in loads.items():
            fwd, total = time_kernel(kernel, cus, device, args.repeats)
            flops = causal_flops(cus)
            row = {"kernel": name, "workload": load, "micro_batches": len(cus), "forward_ms": fwd,
                   "fwd_bwd_ms": total, "fwd_tflops": flops / fwd / 1e9, "fwd_bwd_tflops": 3.5 * flops / total / 1e9,
                   **{f"rel_err_{k}": v for k, v in errors.items()}}
            raw.append(row)
            rows.append(f"| {name} | {load} | {len(cus)} | {fwd:.2f} | {row['fwd_tflops']:.0f} | {total:.2f} | "
                        f"{row['fwd_bwd_tflops']:.0f} | " + " / ".join(f"{errors[k]:.2e}" for k in errors) + " |")
            print(rows[-1], flush=True)
    print("\n| kernel | workload | micro-batches | forward ms | forward TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
          "relative error vs fp32: out / dq / dk / dv |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    base = {r["workload"]: r["fwd_bwd_ms"] for r in raw if r["kernel"] == "flash2"}
    for r in raw:
        if r["kernel"] != "flash2" and r["workload"] in base:
            print(f"{r['kernel']} / flash2, fwd+bwd, {r['workload']}: {base[r['workload']] / r['fwd_bwd_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
