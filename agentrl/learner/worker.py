"""The machinery every learner role shares: one FSDP2-sharded HF model on this rank's device.

A role (policy.py, critic.py, reference.py) builds its module around an HF model and hands it here; this
class shards it (fsdp.py), owns the optimizer and schedule (optim.py), runs micro-batches from packing.py
forward (`_infer`) or forward and backward with gradient accumulation (`_train`), takes the optimizer step
behind a grad-norm clip and a NaN/inf guard, moves the learning-rate schedule once per trainer step
(`end_step`), and exposes the full state for weight sync and checkpoints
(checkpoint.py). Every method that touches weights is collective: all ranks call it, in the same order,
with their own `Batch` of the same packing.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import aggregation_weights
from agentrl.learner import checkpoint, lora
from agentrl.learner.attention import enable_packed_attention
from agentrl.learner.config import LearnerConfig
from agentrl.learner.fsdp import (
    DistContext,
    FusedGradAccumulation,
    decoder_blocks,
    init_distributed,
    reshard_all,
    shard,
)
from agentrl.learner.optim import build_optimizer, build_scheduler
from agentrl.learner.packing import Batch, MicroBatch


def load_causal_lm(config: LearnerConfig, model: nn.Module | None = None) -> nn.Module:
    """The HF causal LM a role wraps: `model` if given (tests, benchmarks), else from `config.model`,
    in float32 (FSDP keeps float32 master weights; compute dtype is set by the mixed-precision policy)."""
    if model is not None:
        return model.float()
    if not config.model:
        raise ValueError("learner.model is empty: name an HF model or a local checkpoint directory")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)


def model_inputs(mb: MicroBatch) -> dict[str, object]:
    """Keyword arguments of an HF base model's forward for one packed micro-batch (see attention.py)."""
    return {
        "input_ids": mb.input_ids_T[None],
        "position_ids": mb.position_ids_T[None],
        "use_cache": False,
        "cu_seq_lens_q": mb.cu_seqlens_S,
        "cu_seq_lens_k": mb.cu_seqlens_S,
        "max_length_q": mb.max_seqlen,
        "max_length_k": mb.max_seqlen,
    }


def loss_weights(mb: MicroBatch, batch: Batch, algo: AlgoConfig) -> tuple[Tensor, Tensor]:
    """Per-token weights of `mb` under the algorithm's loss aggregation over the whole `batch`, and the
    plain token-mean weights (for metrics): sum(w * x) is then the batch's share of this micro-batch."""
    weights_T = aggregation_weights(
        mb.loss_mask_T, mb.seq_index_T, len(mb.rows), algo.loss_agg, batch.num_loss_tokens,
        batch.num_loss_sequences, algo.loss_norm_tokens,
    )
    return weights_T, mb.loss_mask_T / max(batch.num_loss_tokens, 1)


# "auto" takes one FSDP unit where the whole model's 16-bit weights and gradients, held at once instead of
# block by block, cost at most this share of the device's memory (6 bytes per parameter for a trained
# model, 2 for a frozen one: +9 GiB for a 1.5B policy, +42 GiB for a 7B one).
AUTO_MODEL_UNIT_SHARE = 0.15


def auto_unit(module: nn.Module, ctx: DistContext, trainable: bool) -> str:
    """FSDP unit for fsdp_unit="auto": "model" on one rank when its memory cost is small, else "block".
    One unit drops FSDP's per-block hooks, host work that can bound the short micro-batches of a small model
    (measured faster on packed micro-batches: BENCHMARKS.md); several ranks keep per-block units, which shard
    weights."""
    if ctx.world_size > 1:
        return "block"
    extra = sum(p.numel() for p in module.parameters()) * (6 if trainable else 2)
    return "model" if extra <= AUTO_MODEL_UNIT_SHARE * device_memory(ctx.device) else "block"


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device` (a GPU's, or the host's RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Dense 16-bit (bf16 / fp16) tensor-core peaks, TFLOP/s, by a name the device's name contains; the first
# that matches wins (an H100 PCIe before the SXM part). Vendors' figures without sparsity.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
               ("GH200", 989.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0),
               ("L40", 181.0), ("L4", 121.0))


def peak_flops(device: torch.device, configured_tflops: float | None) -> float | None:
    """FLOP/s the device peaks at: `configured_tflops` (learner.peak_tflops) if set, else a known GPU's."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for part, tflops in PEAK_TFLOPS if part in name), None)


def flops_per_token(module: nn.Module) -> float:
    """Training FLOPs a token costs: 2N forward and 2N for the gradients of the activations over all N
    parameters, 2 per trained parameter for their weight gradients: 6N for full training (6·N·T), about 4N
    for a LoRA policy whose base is frozen. Recomputation (activation checkpointing) is not counted."""
    total = sum(p.numel() for p in module.parameters())  # a DTensor's numel is the whole tensor's
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return 4.0 * total + 2.0 * trained


class Worker:
    """One role's sharded module, optimizer and step counters. `hf_model` is the HF model inside `module`
    whose attention is switched to packed attention and whose decoder blocks are sharded one by one;
    `hf_prefix` is its name inside `module` (stripped for weight sync and HF export)."""

    role = "learner"  # metric namespace, set by each role

    def __init__(
        self, config: LearnerConfig, module: nn.Module, hf_model: nn.Module, hf_prefix: str, trainable: bool,
        ctx: DistContext,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.hf_prefix = hf_prefix
        use_bf16 = config.precision == "bf16" or (config.precision == "auto" and ctx.device.type == "cuda")
        self.compute_dtype = torch.bfloat16 if use_bf16 else torch.float32
        enable_packed_attention(hf_model, config.attention_kernel)
        module.eval()  # dropout off: logprobs must be those of the policy that sampled
        if not trainable:
            module.requires_grad_(False)
        # Frozen weights (a reference model; a LoRA policy's base) need no float32 master copy; buffers (RoPE
        # frequencies) stay float32 as in the policy.
        frozen = [p for p in module.parameters() if not p.requires_grad]
        for param in frozen:
            param.data = param.data.to(self.compute_dtype)
        self.adapted = trainable and bool(frozen)  # LoRA (lora.py): only the adapter trains, syncs and is saved
        self.fsdp_unit = config.fsdp_unit if config.fsdp_unit != "auto" else auto_unit(module, ctx, trainable)
        self.reshard_after_forward = (config.reshard_after_forward if config.reshard_after_forward is not None
                                      else self.fsdp_unit == "block")
        self.module = shard(
            module, decoder_blocks(hf_model), ctx,
            param_dtype=self.compute_dtype if trainable and use_bf16 else None,
            reshard_after_forward=self.reshard_after_forward,
            activation_checkpointing=config.activation_checkpointing and trainable,
            compiled=config.compile,
            unit=self.fsdp_unit,
        )
        # one FSDP unit with 16-bit compute: its float32 gradient sums in one foreach call (fsdp.py)
        self.grad_accumulation = (FusedGradAccumulation(self.module, compiled=config.compile)
                                  if trainable and use_bf16 and self.fsdp_unit == "model" else None)
        trained = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(trained, config.optim) if trainable else None
        self.scheduler = build_scheduler(self.optimizer, config.optim) if self.optimizer else None
        self.flops_per_token = flops_per_token(self.module)
        self.peak_flops = peak_flops(ctx.device, config.peak_tflops)
        self.steps = 0  # optimizer steps taken
        # The schedule counts trainer steps (`end_step`), not optimizer steps: warmup and cosine lengths are
        # then the run's steps whatever its mini-batches and PPO epochs, as veRL's recipes count them.
        self.skipped_steps = 0  # steps the NaN/inf guard refused
        self.skipped_in_a_row = 0  # of those, since the last step taken

    @staticmethod
    def context(config: LearnerConfig) -> DistContext:
        ctx = init_distributed(config.device)
        torch.manual_seed(config.seed)  # same on every rank: new heads start identical everywhere
        return ctx

    # -- running micro-batches ---------------------------------------------------------------------

    def _check(self, batch: Batch) -> None:
        if batch.world_size != self.ctx.world_size or batch.rank != self.ctx.rank:
            raise ValueError(f"batch packed for rank {batch.rank}/{batch.world_size}, "
                             f"this is rank {self.ctx.rank}/{self.ctx.world_size}")

    @torch.no_grad()
    def _infer(self, batch: Batch, fn: Callable[[MicroBatch], Tensor]) -> Tensor:
        """Per-token outputs of `fn` over this rank's micro-batches -> the whole batch's response layout
        [B, R] on CPU, identical on every rank."""
        self._check(batch)
        micro_batches = [mb.to(self.ctx.device) for mb in batch.micro_batches]  # all copies queued up front
        outs = [fn(mb) for mb in micro_batches]
        result = batch.gather(outs)
        reshard_all(self.module)
        if self.ctx.world_size > 1:
            result = result.to(self.ctx.device)
            dist.all_reduce(result)  # rows are disjoint across ranks: the sum is the union
        return result.cpu()

    def _train(self, batch: Batch, micro_loss: Callable[[MicroBatch], tuple[Tensor, dict[str, Tensor]]]) -> dict[str, float]:
        """Forward/backward every micro-batch (gradients summed; FSDP syncs them on the last one), then one
        optimizer step. `micro_loss` returns the micro-batch's share of the batch loss and summable stats."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__} is frozen: it has no optimizer")
        self._check(batch)
        start = time.perf_counter()
        sums: dict[str, Tensor] = {}
        micro_batches = [mb.to(self.ctx.device) for mb in batch.micro_batches]  # all copies queued up front
        last = len(micro_batches) - 1
        # With reshard_after_forward off, weights also stay gathered between the micro-batches of a step
        # (no all-gather per micro-batch); the last backward frees them as usual.
        keep_gathered = not self.reshard_after_forward
        fused = self.grad_accumulation if last > 0 else None  # one micro-batch: FSDP reduces it, no sum
        dropout = self.adapted and self.config.lora is not None and self.config.lora.dropout > 0
        lora.set_dropout(self.module, dropout)  # the adapters' dropout, in training forwards only
        try:
            self._accumulate(micro_batches, micro_loss, fused, keep_gathered, sums)
        finally:
            lora.set_dropout(self.module, False)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step applies
        with record_function("agentrl.optimizer"):
            grad_norm, skipped = self._optimizer_step(empty=batch.num_loss_tokens == 0)
        metrics = self._all_reduce(sums | {"tokens": torch.tensor(float(batch.num_tokens), device=self.ctx.device)})
        elapsed = time.perf_counter() - start
        tokens = metrics.pop("tokens")
        metrics |= {"grad_norm": grad_norm, "lr": lr, "step_skipped": float(skipped),
                    "skipped_steps": float(self.skipped_steps)}
        out = {f"{self.role}/{k}": v for k, v in metrics.items()}
        out[f"perf/{self.role}_tokens"] = tokens
        out[f"perf/{self.role}_tokens_per_s"] = tokens / elapsed
        if self.peak_flops:  # per device, over the update's own time
            out[f"perf/{self.role}_mfu"] = self.flops_per_token * tokens / self.ctx.world_size / elapsed / self.peak_flops
        return out

    def _accumulate(self, micro_batches: list[MicroBatch], micro_loss: Callable[[MicroBatch], tuple[Tensor, dict[str, Tensor]]],
                    fused: FusedGradAccumulation | None, keep_gathered: bool, sums: dict[str, Tensor]) -> None:
        """Forward and backward of each micro-batch, gradients summed and synced on the last; stats into `sums`."""
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            self.module.set_requires_gradient_sync(i == last)
            if keep_gathered:
                self.module.set_reshard_after_backward(i == last)
            with record_function("agentrl.forward"):
                loss, stats = micro_loss(mb)
            if fused is not None:
                fused.arm(loss)
            with record_function("agentrl.backward"):
                loss.backward()
            for k, v in stats.items():
                sums[k] = sums[k] + v.detach().float() if k in sums else v.detach().float()

    def _optimizer_step(self, empty: bool = False) -> tuple[float, bool]:
        """Clip by global grad norm and step, unless the norm is NaN/inf: then drop the gradients, leave
        the weights, optimizer moments and schedule alone, and count the skip (`skipped_steps`). The fused
        AdamW kernel reads the verdict from the device (`found_inf`, as under a grad scaler), so the step is
        queued before the host waits for the norm: the GPU does not idle while the host decides.
        An `empty` batch (no loss tokens: e.g. every row overlong-filtered) is skipped the same way, or
        weight decay and the moments would move on a batch that taught nothing."""
        assert self.optimizer is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.config.optim.grad_clip or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        found_inf = torch.ones_like(norm) if empty else (~torch.isfinite(norm)).float()
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]  # read by the fused step
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        norm_value = float(norm)  # the one host sync of the step, after the step is queued
        diverged = not math.isfinite(norm_value)
        self.skipped_steps += diverged
        if diverged:
            self.skipped_in_a_row += 1
        elif not empty:  # an empty batch is no evidence either way
            self.skipped_in_a_row = 0
        skipped = empty or diverged
        if not skipped:
            self.steps += 1
        return norm_value, skipped

    def end_step(self) -> None:
        """One trainer step is done (one update over all its mini-batches and PPO epochs): the learning rate
        moves to the next step's. It moves on a step whose optimizer steps were all skipped too, so step N
        trains at the schedule's rate for N whatever happened before. Collective like the step itself."""
        if self.scheduler is None:
            raise RuntimeError(f"{type(self).__name__} is frozen: it has no schedule")
        self.scheduler.step()

    def _all_reduce(self, values: dict[str, Tensor]) -> dict[str, float]:
        if not values:
            return {}
        keys = sorted(values)
        stacked = torch.stack([values[k].to(self.ctx.device).float().reshape(()) for k in keys])
        if self.ctx.world_size > 1:
            dist.all_reduce(stacked)
        return dict(zip(keys, stacked.tolist(), strict=True))

    # -- state ---------------------------------------------------------------------------------------

    def state_for_sync(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor on this device) per parameter, one at a time, in `dtype` (default: the
        compute dtype); with LoRA the adapter's only (the engine holds the same frozen base). Collective:
        every rank must exhaust the iterator."""
        return checkpoint.iter_full_state(self.module, self.hf_prefix, dtype or self.compute_dtype,
                                          trained_only=self.adapted)

    def save(self, path: str, extra: dict[str, object] | None = None) -> None:
        """Checkpoint weights (with LoRA the adapter's: the base is the model's own), optimizer, schedule, step
        counters, RNG of every rank and `extra` (e.g. the trainer's data position) to `path`. Collective."""
        state = {"steps": self.steps, "skipped_steps": self.skipped_steps, "extra": extra or {}}
        checkpoint.save(path, self.module, self.optimizer, self.scheduler, state, self.ctx, trained_only=self.adapted)

    def load(self, path: str) -> dict[str, object]:
        """Restore what `save` wrote; returns its `extra`. Collective."""
        state = checkpoint.load(path, self.module, self.optimizer, self.scheduler, self.ctx, trained_only=self.adapted)
        reshard_all(self.module)
        self.steps, self.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
        return dict(state["extra"])
