"""Group-level choices between the reward and the advantage: DAPO's dynamic sampling and overlong shaping.

The trainer takes each step's groups as they arrive through `StepIntake` (stale ones dropped), which offers
each to `DynamicSampler`, keeping the groups that carry a learning signal (rewards not all equal) until the
step's batch is full;
`flatten_groups` then gives advantage.py its `rewards_B` and `group_ids_B`. `overlong_penalty` is added to
rewards before advantages; `keep_untruncated` zeroes the loss of truncated trajectories (applied by the
packer as a whole-row factor on `Trajectory.loss_mask`, never by rebuilding the mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from agentrl.types import Group, Prompt, StopReason, Trajectory

# Stop reasons that mean "cut by a length budget", the trajectories DAPO's overlong filter masks out.
TRUNCATED = frozenset({StopReason.RESPONSE_BUDGET, StopReason.CONTEXT_LIMIT, StopReason.TURN_LENGTH})


def reward_of(trajectory: Trajectory) -> float:
    if trajectory.reward is None:
        raise ValueError(f"trajectory {trajectory.prompt.id}#{trajectory.sample} has no reward yet")
    return trajectory.reward.score


def without_errored(groups: Sequence[Group]) -> list[Group]:
    """The groups without their errored trajectories (a tool's service failed: not the model's doing), so
    these are neither in the loss nor in their group's statistics; a group left empty is dropped."""
    return [Group(g.prompt, kept) for g in groups if (kept := [t for t in g.trajectories if t.error is None])]


def flatten_groups(groups: Sequence[Group]) -> tuple[list[Trajectory], Tensor, Tensor]:
    """Groups -> (trajectories in order, rewards_B, group_ids_B): the inputs of advantage.py."""
    trajectories = [t for g in groups for t in g.trajectories]
    rewards_B = torch.tensor([reward_of(t) for t in trajectories], dtype=torch.float32)
    group_ids_B = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    return trajectories, rewards_B, group_ids_B


def is_informative(group: Group, tol: float = 1e-6) -> bool:
    """A group whose rewards are all equal has zero group-relative advantage everywhere: no gradient."""
    rewards = [reward_of(t) for t in group.trajectories]
    return len(rewards) > 1 and max(rewards) - min(rewards) > tol


class DynamicSampler:
    """DAPO dynamic sampling, one step's filter over groups as they arrive: `offer` keeps a group that
    carries a learning signal (`is_informative`). The step stops taking groups once `target_groups` are kept
    or, `exhausted`, once it has seen `max_rounds` x `target_groups` (the most that many generation rounds
    of a step's size would draw). `stats` gives the step's metrics; the rounds are the groups seen in
    steps' worth, rounded up."""

    def __init__(self, target_groups: int, max_rounds: int) -> None:
        if target_groups < 1 or max_rounds < 1:
            raise ValueError("DynamicSampler needs target_groups >= 1 and max_rounds >= 1")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.seen = 0
        self.informative = 0

    def offer(self, group: Group) -> bool:
        """Whether to keep `group`."""
        self.seen += 1
        if is_informative(group):
            self.informative += 1
            return True
        return False

    @property
    def exhausted(self) -> bool:
        return self.seen >= self.max_rounds * self.target_groups

    def stats(self) -> dict[str, float]:
        return {
            "rollout/dynamic_sampling_rounds": float(-(-self.seen // self.target_groups)),
            "rollout/informative_group_frac": self.informative / self.seen if self.seen else 0.0,
        }


# A scored group as the trainer's producer hands it over: (draw index, epoch, prompt, group).
Scored = tuple[int, int, Prompt, Group]


class StepIntake:
    """What one training step took of the scored groups as they arrived: every group (`all`), the stale
    ones (their oldest token too many policy versions old), the fresh ones (the rest), the kept ones (fresh,
    and informative where DAPO's filter is on)."""

    def __init__(self, version: int, sampler: DynamicSampler) -> None:
        self.version, self.sampler = version, sampler  # the learner's version when the step began
        self.all: list[Scored] = []
        self.stale: list[Scored] = []
        self.fresh: list[Scored] = []
        self.kept: list[Scored] = []

    def add(self, item: Scored, max_lag: int, dynamic_sampling: bool) -> bool:
        """Whether `item` is kept: its oldest token at most `max_lag` versions old, and informative where
        DAPO's filter is on."""
        self.all.append(item)
        versions = [v for tr in item[3].trajectories for v in tr.versions]
        if self.version - min(versions, default=self.version) > max_lag:
            self.stale.append(item)
            return False
        self.fresh.append(item)
        if dynamic_sampling and not self.sampler.offer(item[3]):
            return False
        self.kept.append(item)
        return True


def overlong_penalty(response_lens_B: Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to L_max - L_cache, then falling linearly
    to -penalty at L_max, and -penalty beyond. L_max = max_tokens, L_cache = buffer_tokens."""
    lens_B = response_lens_B.to(torch.float32)
    if buffer_tokens == 0:
        return torch.where(lens_B > max_tokens, -penalty, 0.0)
    start = max_tokens - buffer_tokens
    return (-(lens_B - start).clamp(min=0) / buffer_tokens * penalty).clamp(min=-penalty)


def keep_untruncated(trajectories: Sequence[Trajectory]) -> Tensor:
    """1.0 for trajectories that ended on their own, 0.0 for those a length budget cut (overlong filter)."""
    return torch.tensor([0.0 if t.stop_reason in TRUNCATED else 1.0 for t in trajectories])
