"""Rewards by name: a task spec says `reward: {name: math, params: {...}}` and the trainer builds it here.

A reward is called once per trajectory with the response text only, never the prompt:
`reward(response, ground_truth, *, tool_calls=0, tool_errors=0) -> RewardResult`, the score plus named
sub-scores (`correct`, `has_answer`, ...) that the trainer logs as `reward/<name>`. `ground_truth` is one
answer or a list of acceptable ones. math.py grades boxed math answers (TORL); qa.py scores `<answer>`
tags by exact match or F1 (Search-R1). Each reward class carries its parameters as a nested `Params`
model, so task.py validates them with `params_model(name)` before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from agentrl.config import StrictModel
from agentrl.rewards.math import MathReward
from agentrl.rewards.qa import QAF1, QAExactMatch
from agentrl.types import RewardResult, Trajectory


class Reward(Protocol):
    def __call__(
        self, response: str, ground_truth: str | list[str], *, tool_calls: int = 0, tool_errors: int = 0
    ) -> RewardResult: ...


REWARDS: dict[str, type] = {"math": MathReward, "qa_em": QAExactMatch, "qa_f1": QAF1}


def params_model(name: str) -> type[StrictModel]:
    """The parameter model of reward `name`; ValueError naming the known rewards otherwise."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; expected one of: {', '.join(REWARDS)}")
    return REWARDS[name].Params


def build_reward(name: str, params: dict[str, Any] | None = None) -> Reward:
    """Reward `name` with `params` validated by its `Params` model (an unknown key is a pydantic
    ValidationError naming it)."""
    model = params_model(name)
    return REWARDS[name](model.model_validate(params or {}))


def model_text(trajectory: Trajectory, tokenizer: Any) -> str:
    """What the model wrote in `trajectory`: its sampled segments decoded, never the prompt or a tool
    observation (a program printing `\\boxed{42}` must not earn the reward for 42)."""
    return "".join(tokenizer.decode(s.token_ids) for s in trajectory.segments if s.source == "model")


def score(trajectories: Iterable[Trajectory], reward: Reward, tokenizer: Any) -> None:
    """Set each trajectory's `reward` from the text the model wrote and its tool calls."""
    for t in trajectories:
        errors = sum(not r.result.ok for r in t.tool_records)
        t.reward = reward(model_text(t, tokenizer), t.prompt.ground_truth, tool_calls=len(t.tool_records),
                          tool_errors=errors)
