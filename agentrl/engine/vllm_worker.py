"""Runs inside each vLLM worker process: the methods engine/vllm.py calls through `collective_rpc`.

vLLM mixes this class into its GPU worker (`worker_extension_cls`), so `self.model_runner` is the
worker's model runner. Tensors arrive as safetensors bytes with Hugging Face parameter names; the model's
own `load_weights` maps them to vLLM's fused and tensor-parallel-sharded layout and copies them in place.
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
