"""Rewards: a built-in one by name (`reward: {name: math, params: {...}}`), or a function of the user's own
(`reward: {function: file.py:name}`, function.py); the trainer builds the task's here (`task_reward`).

A reward is called once per trajectory with the response text only, never the prompt:
`reward(response, ground_truth, *, tool_records=()) -> RewardResult` (a user's function: awaitable), the
score plus named sub-scores (`correct`, `has_answer`, ...) that the trainer logs as `reward/<name>`.
`ground_truth` is one answer or a list of acceptable ones. math.py grades boxed math answers (TORL); qa.py
scores `<answer>` tags by exact match or F1 (Search-R1); `environment` sums the rewards a task's environment
gave its steps (agentrl/environments.py), kept in the tool records. Each built-in reward class carries its parameters
as a nested `Params` model, so task.py validates them with `params_model(name)` before anything is built.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any, Protocol

from agentrl.config import StrictModel
from agentrl.rewards.function import FunctionReward, RewardFailed
from agentrl.rewards.math import MathReward
from agentrl.rewards.qa import QAF1, QAExactMatch
from agentrl.types import RewardResult, ToolRecord, Trajectory

_log = logging.getLogger(__name__)


class Reward(Protocol):
    def __call__(self, response: str, ground_truth: str | list[str], *,
                 tool_records: Sequence[ToolRecord] = ()) -> RewardResult | Awaitable[RewardResult]: ...


class EnvironmentReward:
    """The sum of the rewards the task's environment gave the trajectory's steps (0 when it gave none), with
    the number of steps that gave one as the part `rewarded_steps`."""

    class Params(StrictModel):
        pass

    def __init__(self, params: Params) -> None:
        self.params = params

    def __call__(self, response: str, ground_truth: str | list[str], *,
                 tool_records: Sequence[ToolRecord] = ()) -> RewardResult:
        given = [r.result.metadata["reward"] for r in tool_records if "reward" in r.result.metadata]
        return RewardResult(float(sum(given)), {"rewarded_steps": float(len(given))})


REWARDS: dict[str, type] = {"math": MathReward, "qa_em": QAExactMatch, "qa_f1": QAF1, "environment": EnvironmentReward}


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


def task_reward(spec: Any, workers: int = 2) -> Reward:
    """The reward a task spec's `reward` (a task_spec.RewardSpec, which imports this package) names: built
    in (`name`, with `params`), or the user's `function`, run by `workers` processes."""
    if spec.function is not None:
        return FunctionReward(spec.function, spec.params, spec.timeout_s, workers)
    return build_reward(spec.name, spec.params)


def close_reward(reward: Reward) -> None:
    """Release what a reward holds (a user's function's worker processes); built-in rewards hold nothing."""
    close = getattr(reward, "close", None)
    if close is not None:
        close()


async def score(trajectories: Iterable[Trajectory], reward: Reward, tokenizer: Any) -> None:
    """Set each trajectory's `reward` from the text the model wrote and its tool calls. A user's reward
    that failed for a trajectory errors it (`error` "reward": out of the loss, counted), scored 0."""
    for t in trajectories:
        try:
            result = reward(model_text(t, tokenizer), t.prompt.ground_truth, tool_records=t.tool_records)
            t.reward = await result if inspect.isawaitable(result) else result
        except RewardFailed as e:
            _log.warning("%s", e)
            t.reward, t.error = RewardResult(0.0), t.error or "reward"
