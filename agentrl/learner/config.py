"""Learner settings: the model, precision, micro-batching, memory/speed switches and the optimizer.

Read by worker.py (and policy.py, critic.py, reference.py built on it) and optim.py. The run config
composes one `LearnerConfig` per role (actor, critic, reference); the algorithm's own settings
(clip ranges, KL, aggregation) are `agentrl.algo.AlgoConfig`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from agentrl.config import StrictModel


class OptimConfig(StrictModel):
    """AdamW with linear warmup and a constant or cosine schedule; gradient-norm clipping. The schedule's
    steps are trainer steps (one learner update over all of a step's mini-batches and PPO epochs; an SFT
    step), not optimizer steps."""

    lr: float = Field(1e-6, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    warmup_steps: int = Field(0, ge=0, description="trainer steps of linear warmup")
    schedule: Literal["constant", "cosine"] = "constant"
    total_steps: int | None = Field(None, ge=1, description="cosine: the trainer step the schedule ends at; "
                                    "unset: the run's last step (trainer.steps, or what its epochs come to)")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine: the final lr as a fraction of lr")
    grad_clip: float | None = Field(1.0, gt=0.0, description="max global grad norm; unset: no clipping")

    def for_run(self, steps: int) -> OptimConfig:
        """This schedule in a run of `steps` trainer steps: a cosine without its own end ends there."""
        if self.schedule == "cosine" and self.total_steps is None:
            return self.model_copy(update={"total_steps": steps})
        return self


class LoraSpec(StrictModel):
    """LoRA adapters (learner/lora.py): peft's low-rank layers on `target_modules`, every other weight frozen.
    The update is W + (alpha / rank) * B @ A, B starting at zero (the adapted model starts as the base)."""

    rank: int = Field(32, ge=1)
    alpha: float = Field(64.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="on the adapter's input, in training forwards only")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="names (or name endings) of the Linear modules to adapt; all-linear: every "
        "Linear of the decoder, not the output head")


class LearnerConfig(StrictModel):
    """One FSDP2 worker group (policy, critic or reference) over an HF causal LM."""

    model: str = Field("", description="HF model name or local path (unused when a model object is given)")
    device: Literal["auto", "cuda", "cpu"] = "auto"
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="compute dtype; auto: bf16 on GPU (fp32 master weights), fp32 on CPU"
    )
    token_budget: int = Field(8192, ge=1, description="tokens per micro-batch (packed, no padding)")
    logprob_chunk_tokens: int = Field(
        2048, ge=1, description="tokens per chunk of the vocabulary projection (bounds fp32 logits memory)"
    )
    logprob_keep_logits: bool = Field(
        False, description="keep 16-bit logits for backward instead of recomputing them (faster, more memory)"
    )
    temperature: float = Field(1.0, gt=0.0, description="logits are divided by it: the sampling temperature")
    activation_checkpointing: bool = False
    attention_kernel: Literal["flash2", "fa4"] = Field(
        "flash2", description="packed attention on CUDA in 16-bit: torch's FlashAttention-2 varlen, or the "
        "flash-attn-4 package's kernels (Hopper/Blackwell; must be installed)"
    )
    compile: bool = Field(False, description="torch.compile each decoder block (each FSDP unit) and the logprob math")
    fsdp_unit: Literal["auto", "block", "model"] = Field(
        "auto", description="FSDP unit: each decoder block (weights gathered block by block), or the whole "
        "model (gathered at once, no per-block FSDP hooks: one GPU, or 16-bit weights that fit on each GPU); "
        "auto: model on one rank when that costs at most 15% of the device's memory (worker.auto_unit), else block"
    )
    reshard_after_forward: bool | None = Field(
        None, description="FSDP: free gathered weights after forward (less memory, one more all-gather per "
        "micro-batch); off, weights also stay gathered across a step's micro-batches. Default (null): off when "
        "the whole model is one FSDP unit (backward needs all of it at once, so freeing it saves nothing), on "
        "with per-block units"
    )
    seed: int = 0
    peak_tflops: float | None = Field(None, gt=0, description="the device's dense 16-bit peak, the denominator of "
                                      "perf/<role>_mfu; default: built in for known GPUs (worker.PEAK_TFLOPS), "
                                      "none on a CPU (no MFU logged)")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraSpec | None = Field(None, description="train LoRA adapters instead of the full weights (set from "
                                                     "model.lora)")
