"""Runs inside each vLLM worker process: the methods engine/vllm.py calls through `collective_rpc`.

vLLM mixes this class into its GPU worker (`worker_extension_cls`), so `self.model_runner` is the
worker's model runner. Tensors arrive as safetensors bytes with Hugging Face parameter names; the model's
own `load_weights` maps them to vLLM's fused and tensor-parallel-sharded layout and copies them in place.
Tensors already on the worker's GPU (a learner colocated on it) arrive instead as a CUDA IPC handle of
one flat bucket and the name, dtype, shape and byte offset of each tensor in it (`agentrl_load_ipc`): the
worker maps the sender's memory and loads views of it, so the weights never leave the GPU. An engine on
GPUs of its own (split placement) joins the learner's NCCL group once (`agentrl_join_group`) and receives
each flat bucket by broadcast (`agentrl_receive_bucket`). Only torch and safetensors are imported at the
top: this module loads in every worker.
"""

from __future__ import annotations

import torch


class WeightUpdateExtension:
    model_runner: object  # provided by the vLLM worker this class is mixed into

    def agentrl_load_weights(self, payload: bytes) -> int:
        from safetensors.torch import load

        tensors = load(payload)
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        model.load_weights(weights=[(name, t.to(device, non_blocking=True)) for name, t in tensors.items()])
        torch.cuda.synchronize(device)
        return len(tensors)

    def agentrl_load_ipc(self, handle: bytes, layout: list) -> int:
        """`handle`: the pickled arguments of torch's `rebuild_cuda_tensor` for a flat uint8 bucket on
        this GPU; `layout`: (name, dtype name, shape, byte offset) per tensor in it."""
        import pickle

        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        flat = rebuild_cuda_tensor(*pickle.loads(handle))
        self._load_flat(flat, layout)  # done reading the sender's memory before it returns
        del flat
        return len(layout)

    def agentrl_join_group(self, host: str, port: int, world: int, offset: int) -> None:
        """Join the learner's weight-broadcast group (NCCL, rank 0 the learner) as rank offset + this worker's
        rank in its engine. vLLM's stateless group: it stays apart from the engine's own process groups."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        rank = offset + int(getattr(self, "rank", 0))
        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world)
        self._agentrl_group = PyNcclCommunicator(group, device=torch.cuda.current_device())

    def agentrl_receive_bucket(self, layout: list, nbytes: int) -> int:
        """Receive a flat bucket the learner broadcasts in the weight group and load views of it."""
        flat = torch.empty(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
        self._agentrl_group.broadcast(flat, src=0, stream=torch.cuda.current_stream())
        self._load_flat(flat, layout)
        return len(layout)

    def _load_flat(self, flat: torch.Tensor, layout: list) -> None:
        """Load the tensors `layout` places in `flat` (engine.flat_bucket's format), then wait for the copies."""
        weights = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            count = 1
            for n in shape:
                count *= n
            nbytes = count * torch.empty((), dtype=dt).element_size()
            weights.append((name, flat[offset : offset + nbytes].view(dt).view(*shape)))
        model = self.model_runner.model  # type: ignore[attr-defined]
        model.load_weights(weights=weights)
        torch.cuda.synchronize(flat.device)
