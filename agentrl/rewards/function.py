"""A reward function of the user's own, named by the task spec:

    reward: {function: examples/rewards/close_enough.py:close_enough, params: {tolerance: 0.01}, timeout_s: 10}

It is called as `score(response, ground_truth, tool_calls, **params)`: `response` is what the model wrote
(its own tokens decoded, never a tool's output, so a program printing an answer cannot earn it),
`ground_truth` the row's answer (a string or a list of them), `tool_calls` the trajectory's calls as
`{"name", "arguments", "output", "error"}` dicts (with the `reward` an environment gave the step, where
it gave one). It returns a number (the score) or a dict with a
`score` and any other named parts, each logged as `reward/<part>`. It runs in a worker process
(tools/function_pool.py) with a time limit; an exception, a time-out or a return of another shape errors
the trajectory (`rollout/errored/reward`): it is left out of the loss and counted, and the run goes on.
"""

from __future__ import annotations

import math
from typing import Any

from agentrl.tools.function_pool import FunctionPool
from agentrl.types import RewardResult, ToolRecord


class RewardFailed(Exception):
    """The reward function failed for one trajectory: it raised, ran out of time, or returned no score."""


class FunctionReward:
    def __init__(self, ref: str, params: dict[str, Any], timeout_s: float, workers: int = 2) -> None:
        self.ref, self.params, self.timeout_s = ref, params, timeout_s
        self.pool = FunctionPool(workers)

    async def __call__(self, response: str, ground_truth: str | list[str], *,
                       tool_records: list[ToolRecord] = ()) -> RewardResult:
        calls = [{"name": r.call.name if r.call else None, "arguments": r.call.arguments if r.call else None,
                  "output": r.result.text, "error": r.result.error}
                 | ({"reward": r.result.metadata["reward"]} if "reward" in r.result.metadata else {})
                 for r in tool_records]
        kwargs = {"response": response, "ground_truth": ground_truth, "tool_calls": calls, **self.params}
        answer = await self.pool.call(self.ref, kwargs, self.timeout_s, as_text=False)
        if answer.error is not None:
            raise RewardFailed(f"reward {self.ref}: {answer.text}")
        return as_reward(answer.value, self.ref)

    def close(self) -> None:
        self.pool.close()


def as_reward(value: Any, ref: str) -> RewardResult:
    """A reward function's return value as a RewardResult; RewardFailed naming what it was otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise RewardFailed(f"reward {ref} returned {value!r}: expected a number or a dict with a 'score'")
    parts = dict(value) if isinstance(value, dict) else {"score": value}
    if "score" not in parts:
        raise RewardFailed(f"reward {ref} returned a dict without 'score': {sorted(parts)}")
    numbers = {k: v for k, v in parts.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and math.isfinite(v)}
    if numbers.keys() != parts.keys():
        raise RewardFailed(f"reward {ref}: every part must be a finite number; got {parts!r}")
    score = float(numbers.pop("score"))
    return RewardResult(score, {k: float(v) for k, v in numbers.items()})
