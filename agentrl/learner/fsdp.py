"""Process group, device and FSDP2 wrapping for the learner's workers.

`init_distributed` joins the process group torchrun (or Ray) set up, or makes a one-process group so a
plain CPU run goes through the same code as a multi-GPU one. `shard` applies, per decoder block
(found through the HF model's `_no_split_modules`): activation checkpointing, then torch.compile, then
`fully_shard`; and `fully_shard` once more on the root, which holds the embeddings, the final norm and
the output head. With `unit="model"` the root is the only FSDP unit: all weights are gathered at once, and
the blocks (still compiled one by one) run without FSDP's per-block hooks, for one GPU or models whose
16-bit weights fit on each GPU. Gradients are summed across ranks, not averaged: the losses
are already normalised by whole-batch counts (agentrl/algo/loss.py). worker.py is the only caller.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# Prefixes wrappers add to parameter names; HF names are what is left when they are removed.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh


def init_distributed(device: str = "auto") -> DistContext:
    """Join (or create) the default process group and pick this rank's device."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("learner.device=cuda but torch sees no GPU")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # gloo alongside nccl lets small CPU tensors (metrics, response-layout results) be reduced too
        backend = "cuda:nccl,cpu:gloo" if use_cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    return DistContext(dist.get_rank(), dist.get_world_size(), dev, mesh)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def decoder_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of each decoder block: modules whose class the HF model declares as not
    to be split (`_no_split_modules`), i.e. its transformer layers."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find its decoder blocks")
    found = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if type(child).__name__ in names:
                found.append((parent, attr))
    if not found:
        raise ValueError(f"no module of {sorted(names)} found in {type(model).__name__}")
    return found


def shard(
    root: nn.Module,
    blocks: list[tuple[nn.Module, str]],
    ctx: DistContext,
    param_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    activation_checkpointing: bool,
    compiled: bool,
    unit: Literal["block", "model"] = "block",
) -> nn.Module:
    """Wrap each block (checkpoint -> compile -> fully_shard unless `unit="model"`), then the root.
    Returns the sharded root."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for parent, attr in blocks:
        block = getattr(parent, attr)
        if activation_checkpointing:
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if compiled:
            block = torch.compile(block, dynamic=True, options=compile_options(ctx.device, activation_checkpointing))
        if unit == "block":
            fully_shard(block, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        parent.register_module(attr, block)
    fully_shard(root, mesh=ctx.mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum, never average, across ranks
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.8; needed by gloo, which
                module.set_force_sum_reduction_for_comms(True)  # has no premultiplied sum (NCCL has)
    return root


def compile_options(device: torch.device, checkpointed: bool = False) -> dict[str, object]:
    """Inductor options for the compiled blocks. On CUDA the C++ wrapper: the code that launches a block's
    kernels is compiled C++, not Python, less host work per micro-batch where the host's launching can
    bound the step (a 1.5B model on 4k-token micro-batches); measured on packed micro-batches, no gain and
    no loss was established (BENCHMARKS.md). Not under activation checkpointing: there inductor wraps the
    flash-attention op (seeded, for dropout) in an RNG-state operator its C++ wrapper cannot emit (torch
    2.11). On the CPU the kernels run synchronously, so host launch time hides nothing and the Python
    wrapper (quicker to build) stays."""
    return {"cpp_wrapper": device.type == "cuda" and not checkpointed}


class FusedGradAccumulation:
    """Float32 gradient accumulation across a step's micro-batches for a one-unit FSDP model (fsdp_unit=
    "model", 16-bit compute), without FSDP's per-parameter Python and, compiled, in a few fused kernels.

    Between micro-batches FSDP2 keeps each parameter's gradient in its reduce dtype (float32) and adds each
    micro-batch's 16-bit gradient to it parameter by parameter: a cast or `+=` kernel and some Python per
    parameter (338 for a Qwen2.5-1.5B) at every micro-batch, time on the GPU and on the host alike. Here the
    same additions are one `_foreach` call over all parameters, in an autograd callback queued ahead of
    FSDP's own: `arm` hooks the loss, whose gradient is the first the backward computes, while FSDP queues
    its final callback from a hook on the model's outputs, computed after it. FSDP then finds no 16-bit
    gradient left (its per-parameter checks still run, cheaply) and reduces the float32 sums as it would its
    own. With `compiled`, inductor fuses the adds across parameters (measured faster per step than FSDP's
    path: BENCHMARKS.md); eager, `_foreach_add_` of float32 and 16-bit lists falls back to one add per
    parameter, launched from C++ (the first micro-batch's cast is fused either way). If the loss is itself
    the model's output, FSDP's hook comes first and FSDP's own path runs. An error raised here leaves the
    step as FSDP's own callback failing would: the backward raises and the step must not be continued.

    It reads and writes FSDP's per-parameter state (`_unsharded_param`, `unsharded_accumulated_grad`),
    private names; tests/test_learner_worker.py checks that the sums are FSDP's to the bit and that this
    path, not FSDP's, made them."""

    def __init__(self, root: nn.Module, compiled: bool) -> None:
        group = root._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        self.params = list(group.fsdp_params) if group is not None else []
        self._copy, self._add = _foreach_copy, _foreach_add
        if compiled:
            self._copy, self._add = (torch.compile(f, dynamic=False) for f in (_foreach_copy, _foreach_add))

    def arm(self, loss: torch.Tensor) -> None:
        """Make the coming `loss.backward()` accumulate through this class."""
        if loss.requires_grad:
            loss.register_hook(self._queue)

    def _queue(self, grad: torch.Tensor) -> torch.Tensor:
        torch.autograd.Variable._execution_engine.queue_callback(self._accumulate)  # type: ignore[attr-defined]
        return grad

    def _accumulate(self) -> None:
        todo = [p for p in self.params  # reduce_dtype exists from FSDP's lazy init, at the first forward
                if p.reduce_dtype is not None and p._unsharded_param.grad is not None
                and p._unsharded_param.grad.dtype != p.reduce_dtype]
        fresh = [p for p in todo if p.unsharded_accumulated_grad is None]
        summed = [p for p in todo if p.unsharded_accumulated_grad is not None]
        if fresh:  # the step's first gradients: cast into one new float32 buffer
            grads = [p._unsharded_param.grad for p in fresh]
            flat = torch.empty(sum(g.numel() for g in grads), dtype=fresh[0].reduce_dtype, device=grads[0].device)
            sums = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
            self._copy(sums, grads)
            for p, total in zip(fresh, sums, strict=True):
                p.unsharded_accumulated_grad = total
        if summed:
            self._add([p.unsharded_accumulated_grad for p in summed], [p._unsharded_param.grad for p in summed])
        for p in todo:
            p._unsharded_param.grad = None


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_copy_(dst, src)


def _foreach_add(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    torch._foreach_add_(dst, src)


def reshard_all(root: nn.Module) -> None:
    """Free gathered weights everywhere. FSDP keeps the root's gathered after a forward (it expects a
    backward); after a no-grad forward or a checkpoint load they would otherwise go stale."""
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clean_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name
