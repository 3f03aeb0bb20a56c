"""Learner -> engine: the policy's new weights into the rollout engines, the only module that knows both.

After each training step the trainer pushes the policy's full weights (HF names, the learner's compute
dtype, one tensor gathered at a time from the sharded module) into every engine, bucket by bucket
(`engine.load_buckets`: an engine that takes serialized buckets gets each bucket encoded once; the others
get the tensors through `update_weights`). A vLLM engine on the learner's GPU maps the tensors by CUDA IPC
instead, so they never leave the GPU. The engines then sample from exactly the weights the learner
holds, which the next step's importance ratios assume. The push is timed (`timing/weight_sync`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from agentrl.engine import load_buckets


async def push_weights(policy: Any, engines: Sequence[Any]) -> dict[str, float]:
    """Send `policy`'s weights to `engines` (collective on the learner's ranks); returns the timing."""
    start = time.perf_counter()
    on_gpu = policy.ctx.device.type == "cuda"
    if len(engines) == 1 and on_gpu and callable(getattr(engines[0], "update_weights_on_gpu", None)):
        await engines[0].update_weights_on_gpu(policy.state_for_sync())  # CUDA IPC: no copy through the host
    else:
        await load_buckets(engines, policy.state_for_sync())
    return {"timing/weight_sync": time.perf_counter() - start}


class WeightBroadcast:
    """The learner's end (rank 0) of the NCCL group it shares with split engines' workers (each joins with
    `join_weight_group`): weights then reach GPUs that hold no learner state by broadcast, one flat bucket
    (`engine.flat_bucket`) per collective, never through the host. vLLM's stateless process group and NCCL
    communicator: the group stays apart from the learner's own (FSDP2's) and from each engine's."""

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
