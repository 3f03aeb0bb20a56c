"""NCCL broadcast between two processes on one GPU, as the split placement's weight sync runs there: GB/s per
socket setting, against NCCL's defaults in the same run.

Two processes on one GPU cannot be one NCCL group as two ranks of one host, so each takes an NCCL host id
of its own (placement.py does the same) and NCCL carries the broadcast as between two hosts, over TCP
sockets on loopback. How many sockets and threads NCCL opens per connection (NCCL_NSOCKS_PERTHREAD x
NCCL_SOCKET_NTHREADS, at most 64) bounds the rate. Each setting gets two fresh processes (NCCL reads its
environment once per process): rank 0 broadcasts a `--gib` GiB buffer `--rounds` times to rank 1 through the
communicator the trainer uses (weight_sync.WeightBroadcast's: vLLM's stateless group and PyNccl), rank 1
checks the bytes, and the median round gives the rate.

    python -m bench.bench_weight_broadcast --settings 1x1 4x4 8x8 --gib 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rank(rank: int, port: int, nbytes: int, rounds: int, env: dict[str, str], out: mp.Queue) -> None:
    os.environ.update(env)
    os.environ["NCCL_HOSTID"] = f"agentrl-bench-{rank}"
    import time

    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host="127.0.0.1", port=port, rank=rank, world_size=2)
    comm = PyNcclCommunicator(group, device=0)
    buf = (torch.arange(nbytes, dtype=torch.int64, device="cuda") % 251).to(torch.uint8) if rank == 0 else \
        torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(rounds + 1):  # the first round sets connections up
        torch.cuda.synchronize()
        start = time.perf_counter()
        comm.broadcast(buf, src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    ok = bool((buf[:4096].to(torch.int64) == torch.arange(4096, device="cuda") % 251).all())
    out.put((rank, times[1:], ok))


def _setting(name: str) -> dict[str, str]:
    socks, threads = (int(x) for x in name.split("x"))
    if socks * threads > 64:
        sys.exit(f"setting {name}: NCCL allows at most 64 sockets per connection (sockets x threads)")
    return {"NCCL_NSOCKS_PERTHREAD": str(socks), "NCCL_SOCKET_NTHREADS": str(threads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", nargs="+", default=["default", "4x4", "8x8"],
                        help="SOCKSxTHREADS (NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS), or default")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from agentrl.learner.fsdp import free_port

    nbytes = int(args.gib * 2**30)
    ctx = mp.get_context("spawn")
    rows = []
    for name in args.settings:
        env = {} if name == "default" else _setting(name)
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, nbytes, args.rounds, env, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        results = dict((r, (t, ok)) for r, t, ok in (out.get(timeout=600) for _ in procs))
        for p in procs:
            p.join()
        times, _ = results[0]
        median = statistics.median(times)
        rows.append({"setting": name, "env": env, "median_s": median, "gb_per_s": nbytes / 1e9 / median,
                     "bytes_ok": results[1][1]})
    base = rows[0]["gb_per_s"]
    print(f"{'setting':>8} {'s per GiB':>10} {'GB/s':>7} {'vs ' + rows[0]['setting']:>11} {'bytes ok':>8}")
    for r in rows:
        print(f"{r['setting']:>8} {r['median_s'] / args.gib:>10.3f} {r['gb_per_s']:>7.2f} {r['gb_per_s'] / base:>11.2f} "
              f"{str(r['bytes_ok']):>8}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
