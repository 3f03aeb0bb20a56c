"""Learner -> engine: the policy's new weights into the rollout engines, every transport in one place.

After each training step the policy's full weights (HF names, the learner's compute dtype, one tensor
gathered at a time from the sharded module: `state_for_sync`, collective over the learner's ranks) go to
every engine. The engines then sample from exactly the weights the learner holds, which the next step's
importance ratios assume. `transport(config)` chooses how, once, from the placement:

    tensors  one process, a transformers engine: `update_weights` with the tensors themselves (an engine in
             a child process or a pool gets each bucket encoded once as safetensors, engine/weights.py)
    ipc      vLLM on the learner's GPU (one process, or Ray rank i to the engine it shares its GPU with):
             each bucket packed into one flat GPU buffer that the engine's workers map by CUDA IPC; the
             weights never leave the GPU
    nccl     vLLM engines on GPUs of their own (Ray, split): rank 0 broadcasts each flat bucket to every
             engine worker in an NCCL group formed once (`WeightBroadcast`)
    bytes    transformers engines on Ray: rank 0 encodes each bucket once as safetensors; it reaches every
             engine through Ray's object store

A LoRA policy sends its adapter only (about 1% of the weights) and vLLM loads an adapter from files, so a
LoRA run's pushes go as tensors (one process) or bytes (Ray) whatever the engine.

`push_weights` is the one-process push, `push_from_rank` a Ray learner rank's. Both are timed
(`timing/weight_sync`, by the caller on Ray).

Every push is checked (`PushProbe`): the engine samples a few tokens of a fixed prompt and the learner scores
the same tokens; their logprobs must agree within the engine's numerics (`sync/probe_gap`, the mean gap over
the tokens). An engine still serving earlier weights, or missing a tensor, fails the run at that step,
naming the transport, once the learner's weights have moved further than the tolerance from them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from agentrl.engine import Sampling
from agentrl.engine.pool import EnginePool
from agentrl.engine.weights import bucket_by_bytes, cuda_ipc_handle, encode_bucket, flat_buckets
from agentrl.types import Prompt, Segment, StopReason, Trajectory


def transport(config: Any) -> str:
    """tensors, ipc, nccl or bytes (the module docstring says when)."""
    full_vllm = config.engine.kind == "vllm" and config.model.lora is None  # vLLM taking the full weights
    if not config.placement.on_ray:
        return "ipc" if full_vllm and config.learner.device != "cpu" else "tensors"
    if not full_vllm:
        return "bytes"
    return "nccl" if config.placement.mode == "split" else "ipc"


async def push_weights(policy: Any, engine: Any, how: str) -> dict[str, float]:
    """`policy`'s weights into the engine of a one-process run (`how`: tensors or ipc); `sync/bytes`: what
    was sent (a LoRA policy sends its adapter only)."""
    start = time.perf_counter()
    sent = [0]
    if how == "ipc":
        await engine.update_weights_on_gpu(_counted(policy, sent))  # a GpuReceiver: no copy through the host
    else:
        await engine.update_weights(_counted(policy, sent))
    return {"timing/weight_sync": time.perf_counter() - start, "sync/bytes": float(sent[0])}


def _counted(policy: Any, sent: list[int]) -> Iterator[tuple[str, Any]]:
    """`policy.state_for_sync()`, adding each tensor's bytes to `sent[0]`."""
    for name, tensor in policy.state_for_sync():
        sent[0] += tensor.numel() * tensor.element_size()
        yield name, tensor


def push_from_rank(policy: Any, rank: int, actors: list[Any], how: str, broadcast: WeightBroadcast | None) -> int:
    """A Ray learner rank's part of a push to the engine actors (ray_placement._EngineActor): every rank
    gathers every tensor (the collective part); then rank i sends to engine i (ipc), or rank 0 to every
    engine (nccl: over `broadcast`; bytes: through the object store). Returns the bytes of the weights."""
    import ray

    sent = [0]
    state = _counted(policy, sent)
    if how == "ipc":
        actors = [actors[rank]]
    elif rank != 0:
        for _ in state:
            pass
        return sent[0]
    if how == "nccl":
        for flat, layout in flat_buckets(state):
            receiving = [a.receive_bucket.remote(layout, flat.numel()) for a in actors]
            broadcast.send(flat)  # type: ignore[union-attr]
            ray.get(receiving)
            del flat
    elif how == "ipc":
        for flat, layout in flat_buckets(state):
            ray.get(actors[0].load_ipc_bucket.remote(cuda_ipc_handle(flat), layout))  # mapped, then freed
            del flat
    else:
        for bucket in bucket_by_bytes(state):
            payload = ray.put(encode_bucket(bucket))
            ray.get([a.load_weight_bucket.remote(payload) for a in actors])
    ray.get([a.weights_loaded.remote() for a in actors])
    return sent[0]


async def push_checked(learner: Any, engine: Any, probe: PushProbe | None, step: int,
                       timeout_s: float | None = None) -> dict[str, float]:
    """The learner's push into `engine`, then its check by `probe` (None: unchecked), within `timeout_s`."""
    async def push() -> dict[str, float]:
        metrics = await learner.push(engine)
        return metrics | (await probe.check(engine, learner, step) if probe is not None else {})

    try:
        return await asyncio.wait_for(push(), timeout_s)
    except TimeoutError:
        raise RuntimeError(f"step {step}: the weight push ({learner.transport}) and its check did not finish within "
                           f"{timeout_s:g} s (trainer.push_timeout_s)") from None


class PushProbe:
    """The check after a push: the engine samples `tokens` of `prompt` (seeded, at the rollout's
    temperature, so its logprobs are the learner's distribution's), the learner scores them, and a mean
    gap above `tolerance` is an error naming the step, the engine and the transport `how`."""

    def __init__(self, prompt: Prompt, tokens: int, temperature: float, tolerance: float, how: str) -> None:
        self.prompt, self.tolerance, self.how = prompt, tolerance, how
        self.sampling = Sampling(max_tokens=tokens, temperature=temperature, seed=0)

    async def check(self, engine: Any, learner: Any, step: int) -> dict[str, float]:
        """Every engine of a pool is probed; `sync/probe_gap` is the largest gap."""
        start = time.perf_counter()
        engines = engine.engines if isinstance(engine, EnginePool) else [engine]
        gaps = [await self._gap(e, learner, step, i) for i, e in enumerate(engines)]
        return {"sync/probe_gap": max(gaps), "timing/probe": time.perf_counter() - start}

    async def _gap(self, engine: Any, learner: Any, step: int, index: int) -> float:
        c = await engine.generate(list(self.prompt.token_ids), self.sampling)
        if not c.token_ids:  # no room left in the engine's context: nothing to compare
            return 0.0
        probe = Trajectory(self.prompt, [Segment("model", list(c.token_ids), list(c.logprobs))], StopReason.EOS)
        learner_lp = await asyncio.to_thread(learner.score, probe)
        gap = sum(abs(a - b) for a, b in zip(c.logprobs, learner_lp, strict=True)) / len(c.logprobs)
        if not gap <= self.tolerance:
            raise RuntimeError(
                f"step {step}: after the weight push ({self.how}) engine {index}'s logprobs of the probe differ "
                f"from the learner's by {gap:.3g} on average over {len(c.logprobs)} tokens (tolerance "
                f"{self.tolerance:g}, trainer.probe_tolerance): the engine does not hold the learner's weights")
        return gap


class WeightBroadcast:
    """The learner's end (rank 0) of the NCCL group it shares with split engines' workers (each joins with
    `join_weight_group`): weights then reach GPUs that hold no learner state by broadcast, one flat bucket
    (`engine.weights.flat_bucket`) per collective, never through the host. vLLM's stateless process group
    and NCCL communicator: the group stays apart from the learner's own (FSDP2's) and from each engine's."""

    def __init__(self, host: str, port: int, world: int) -> None:
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=0, world_size=world)
        self.comm = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def send(self, flat: Any) -> None:
        """Broadcast `flat` to every engine worker (each must be receiving a buffer of its size)."""
        import torch

        self.comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
