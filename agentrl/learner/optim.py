"""AdamW and its learning-rate schedule (linear warmup, then constant or cosine), for worker.py.

`lr_factor` is the schedule as a pure function of the step, so it is tested on its own and the scheduler's
state (checkpoint.py saves it) is just the step count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from agentrl.learner.config import OptimConfig


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of config.lr at optimizer step `step` (0-based): warmup ramps 1/w, 2/w, ... 1."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    assert config.total_steps is not None  # validated by OptimConfig
    span = max(config.total_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    # fused: one kernel launch for all parameters (CUDA and CPU), and it can skip a step on a device-side
    # found_inf flag without a host sync (worker.py's NaN/inf guard)
    return torch.optim.AdamW(
        list(params), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=True,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> LambdaLR:
    return LambdaLR(optimizer, partial(lr_factor, config=config))
