"""Dynamic sampling, overlong shaping and the algorithm config (agentrl/algo/sampling.py, __init__.py)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from agentrl.algo import AlgoConfig
from agentrl.algo.sampling import (
    DynamicSampler,
    flatten_groups,
    is_informative,
    keep_untruncated,
    overlong_penalty,
)
from agentrl.types import Group, Prompt, RewardResult, Segment, StopReason, Trajectory


def _group(name: str, rewards: list[float], stop: StopReason = StopReason.EOS) -> Group:
    prompt = Prompt(id=name, text="", token_ids=(1, 2), question="", ground_truth="")
    trajs = [Trajectory(prompt, [Segment("model", [3], [-0.5])], stop, sample=i, reward=RewardResult(r))
             for i, r in enumerate(rewards)]
    return Group(prompt, trajs)


def test_flatten_groups() -> None:
    trajs, rewards, groups = flatten_groups([_group("a", [1.0, 0.0]), _group("b", [0.5])])
    assert len(trajs) == 3
    assert rewards.tolist() == [1.0, 0.0, 0.5]
    assert groups.tolist() == [0, 0, 1]


def test_dynamic_sampler_keeps_informative_groups_as_they_arrive() -> None:
    assert is_informative(_group("a", [1.0, 0.0]))
    assert not is_informative(_group("b", [1.0, 1.0]))
    assert not is_informative(_group("c", [0.3]))
    sampler = DynamicSampler(target_groups=3, max_rounds=3)
    kept = [g.prompt.id for g in (_group("a", [1, 0]), _group("b", [1, 1]), _group("c", [0, 0]), _group("d", [0, 1]))
            if sampler.offer(g)]
    assert kept == ["a", "d"] and not sampler.exhausted
    assert sampler.stats() == {"rollout/dynamic_sampling_rounds": 2.0,  # 4 groups seen: two steps' worth of 3
                               "rollout/informative_group_frac": pytest.approx(2 / 4)}


def test_dynamic_sampler_exhausts_after_max_rounds_of_groups() -> None:
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    for i in range(3):
        assert not sampler.offer(_group(str(i), [1, 1]))
        assert not sampler.exhausted
    assert sampler.offer(_group("b", [1, 0])) and sampler.exhausted  # 4 = 2 rounds x 2 groups seen
    assert sampler.stats()["rollout/dynamic_sampling_rounds"] == 2.0


def test_overlong_penalty_golden() -> None:
    lens = torch.tensor([50, 80, 90, 100, 120])
    assert overlong_penalty(lens, max_tokens=100, buffer_tokens=20).tolist() == pytest.approx([0, 0, -0.5, -1, -1])
    assert overlong_penalty(lens, 100, 20, penalty=0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5, -0.5])
    assert overlong_penalty(torch.tensor([100, 101]), 100, 0).tolist() == [0.0, -1.0]


def test_keep_untruncated() -> None:
    trajs, _, _ = flatten_groups([_group("a", [1.0], StopReason.RESPONSE_BUDGET), _group("b", [0.0]),
                                  _group("c", [0.0], StopReason.CONTEXT_LIMIT)])
    assert keep_untruncated(trajs).tolist() == [0.0, 1.0, 0.0]


def test_algo_config_validation() -> None:
    cfg = AlgoConfig(advantage="gae", kl={"coef": 0.05, "use": "reward"})
    assert cfg.needs_critic and cfg.needs_reference
    with pytest.raises(ValidationError, match="kl.use=reward"):
        AlgoConfig(advantage="grpo", kl={"coef": 0.05, "use": "reward"})
    with pytest.raises(ValidationError, match="must not exceed overlong.max_tokens"):
        AlgoConfig(overlong={"buffer_tokens": 10, "max_tokens": 5})
    with pytest.raises(ValidationError):
        AlgoConfig(clip_hihg=0.3)  # unknown keys are errors
    with pytest.raises(ValidationError):
        AlgoConfig(dual_clip=0.5)
