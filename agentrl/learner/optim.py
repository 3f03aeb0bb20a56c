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
    """Multiplier of config.lr at trainer step `step` (0-based; worker.end_step moves it): warmup ramps
    1/w, 2/w, ... 1, then constant, or cosine from 1 at the warmup's end to min_lr_ratio at total_steps."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    if config.total_steps is None:
        raise ValueError("learner.optim.schedule=cosine needs optim.total_steps (a run sets it to its last step)")
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
    lr_factor(0, config)  # a cosine without its end fails here, at the start, not at the first step
    return LambdaLR(optimizer, partial(lr_factor, config=config))
