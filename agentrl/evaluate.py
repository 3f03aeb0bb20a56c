"""Evaluation: the trainer's validation, through the same rollout loop, tool format and reward as training.

`evaluate` samples `n` trajectories per prompt (greedy by default), scores them on the text the model
wrote (rewards.score) and reports `val/*` metrics: the mean score, the fraction correct (pass@1 averaged
over the n samples), and the rollout's own metrics (response length, turns, tool calls, stop reasons).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentrl.rewards import Reward, score
from agentrl.rollout import RolloutConfig, rollout, rollout_metrics
from agentrl.task import Budgets
from agentrl.tools import Tool
from agentrl.tools.formats import ToolFormat
from agentrl.types import Prompt, Trajectory


@dataclass
class EvalResult:
    metrics: dict[str, float]
    trajectories: list[Trajectory]


async def evaluate(prompts: Sequence[Prompt], *, engine: Any, fmt: ToolFormat, tools: dict[str, Tool],
                   budgets: Budgets, tokenizer: Any, reward: Reward, n: int = 1, temperature: float = 0.0,
                   seed: int = 0, prefix: str = "val/") -> EvalResult:
    config = RolloutConfig(n=n, temperature=temperature, seed=seed)
    groups = await rollout(prompts, engine=engine, fmt=fmt, tools=tools, budgets=budgets, tokenizer=tokenizer,
                           config=config)
    trajectories = [t for g in groups for t in g.trajectories]
    score(trajectories, reward, tokenizer)
    count = max(len(trajectories), 1)
    metrics = {
        "score": sum(t.reward.score for t in trajectories if t.reward) / count,
        "correct": sum(t.reward.parts.get("correct", 0.0) for t in trajectories if t.reward) / count,
        "prompts": float(len(prompts)),
    }
    metrics |= {k.replace("/", "_", 1): v for k, v in rollout_metrics(trajectories).items()}
    return EvalResult({prefix + k: v for k, v in metrics.items()}, trajectories)
