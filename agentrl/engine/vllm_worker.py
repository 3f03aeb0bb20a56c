"""Runs inside each vLLM worker process: the methods engine/vllm.py calls through `collective_rpc`.

vLLM mixes this class into its GPU worker (`worker_extension_cls`), so `self.model_runner` is the
worker's model runner. Tensors arrive as safetensors bytes with Hugging Face parameter names; the model's
own `load_weights` maps them to vLLM's fused and tensor-parallel-sharded layout and copies them in place.
Tensors already on the worker's GPU (a learner colocated on it) arrive instead as a CUDA IPC handle of
one flat bucket and the name, dtype, shape and byte offset of each tensor in it (`agentrl_load_ipc`): the
worker maps the sender's memory and loads views of it, so the weights never leave the GPU.
Only torch and safetensors are imported here: this module loads in every worker.
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
        torch.cuda.synchronize(flat.device)  # done reading the sender's memory before it is freed
        del weights, flat
        return len(layout)
