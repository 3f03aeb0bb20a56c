"""Advantage estimators (agentrl/algo/advantage.py) against hand-computed numbers and plain loops."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.algo.advantage import (
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards,
    whiten,
)

EPS = 1e-6


def test_grpo_golden() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    s0 = math.sqrt(0.5)  # unbiased std of {1, 0}
    expected = [0.5 / (s0 + EPS), -0.5 / (s0 + EPS), 0.0, 0.0, 0.0, -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)]
    assert grpo_advantages(rewards, groups).tolist() == pytest.approx(expected, abs=1e-6)
    assert grpo_advantages(rewards, groups, std_normalize=False).tolist() == pytest.approx(
        [0.5, -0.5, 0.0, 0.0, 0.0, -0.5, 0.5], abs=1e-7)
    assert drgrpo_advantages(rewards, groups).tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, -0.5, 0.5], abs=1e-7)


def test_rloo_golden() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0])
    groups = torch.tensor([7, 7, 7, 3])  # any labels; a group of one gets 0
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0], abs=1e-7)


def _random_groups(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    rewards, groups = [], []
    for g in range(6):
        for _ in range(rng.randint(1, 5)):
            rewards.append(rng.choice([0.0, 1.0, rng.random()]))
            groups.append(g)
    order = list(range(len(rewards)))
    rng.shuffle(order)  # groups need not be contiguous
    return torch.tensor([rewards[i] for i in order]), torch.tensor([groups[i] for i in order])


@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_loops(seed: int) -> None:
    rewards, groups = _random_groups(seed)
    members: dict[int, list[float]] = {}
    for r, g in zip(rewards.tolist(), groups.tolist(), strict=True):
        members.setdefault(g, []).append(r)
    grpo, rloo = [], []
    for r, g in zip(rewards.tolist(), groups.tolist(), strict=True):
        xs = members[g]
        mean = sum(xs) / len(xs)
        std = statistics.stdev(xs) if len(xs) > 1 else 0.0
        grpo.append((r - mean) / (std + EPS))
        rloo.append(r - (sum(xs) - r) / (len(xs) - 1) if len(xs) > 1 else 0.0)
    assert grpo_advantages(rewards, groups).tolist() == pytest.approx(grpo, abs=1e-5)
    assert rloo_advantages(rewards, groups).tolist() == pytest.approx(rloo, abs=1e-6)


def test_token_rewards_on_last_sampled_token() -> None:
    mask = torch.tensor([[1.0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    out = token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 0, 0, 2, 0], [0, 0, 0, 0, 0], [4, 0, 0, 0, 0]]
    with_kl = token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask, kl_BR=torch.ones(3, 5), kl_coef=0.1)
    assert with_kl[0].tolist() == pytest.approx([-0.1, -0.1, 0.0, 1.9, 0.0])


def test_discounted_returns_skip_tool_tokens() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    assert discounted_returns(rewards, mask, gamma=0.5).tolist() == [[0.25, 0.5, 0.0, 1.0]]


def test_gae_golden() -> None:
    # sampled tokens at 0 and 2, a tool token at 1 whose value is ignored
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.8]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t2: delta = 1 - 0.8 = 0.2; t0: delta = 0.9 * 0.8 - 0.5 = 0.22, gae = 0.22 + 0.72 * 0.2 = 0.364
    assert adv.tolist()[0] == pytest.approx([0.364, 0.0, 0.2])
    assert ret.tolist()[0] == pytest.approx([0.864, 0.0, 1.0])


def _gae_loop(r: list[float], v: list[float], m: list[float], gamma: float, lam: float) -> list[float]:
    idx = [t for t in range(len(m)) if m[t] > 0]
    out = [0.0] * len(m)
    gae = 0.0
    for k in reversed(range(len(idx))):
        t = idx[k]
        next_v = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
        delta = r[t] + gamma * next_v - v[t]
        gae = delta + gamma * lam * gae
        out[t] = gae
    return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_loop(gamma: float, lam: float) -> None:
    torch.manual_seed(0)
    mask = (torch.rand(5, 9) > 0.3).float()
    mask[2] = 0  # a row with nothing sampled
    rewards = torch.randn(5, 9) * mask
    values = torch.randn(5, 9)
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    for b in range(5):
        expected = _gae_loop(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
        assert adv[b].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.allclose(ret, (adv + values) * mask)


def test_whiten_and_reinforce_pp_golden() -> None:
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 99.0]])
    w = whiten(x, mask)
    assert float(w[mask > 0].mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(w[mask > 0].std()) == pytest.approx(1.0, abs=1e-5)
    assert float(w[2, 1]) == 0.0
    # rewards +1 / -1 on two 2-token rows: returns [[1, 1], [-1, -1]]; unbiased std sqrt(4/3)
    adv, ret = reinforce_pp_advantages(torch.tensor([1.0, -1.0]), torch.ones(2, 2))
    assert ret.tolist() == [[1.0, 1.0], [-1.0, -1.0]]
    assert adv.flatten().tolist() == pytest.approx([0.8660254] * 2 + [-0.8660254] * 2, abs=1e-5)
    # the baseline variant subtracts the group mean first: both rows in one group of mean 0.5
    _, ret_b = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.ones(2, 2), group_ids_B=torch.tensor([0, 0]))
    assert ret_b.tolist() == [[0.5, 0.5], [-0.5, -0.5]]


def test_compute_advantages_dispatch() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    adv, ret = compute_advantages(AlgoConfig(), rewards, groups, mask)
    assert ret is None
    assert torch.allclose(adv, broadcast_to_tokens(grpo_advantages(rewards, groups), mask))
    adv, _ = compute_advantages(AlgoConfig(advantage="drgrpo"), rewards, groups, mask)
    assert adv[0].tolist() == [0.5, 0.5, 0.0]
    adv, _ = compute_advantages(AlgoConfig(advantage="rloo"), rewards, groups, mask)
    assert adv[1].tolist() == [-1.0, 0.0, 0.0]
    adv, ret = compute_advantages(AlgoConfig(advantage="reinforce_pp"), rewards, groups, mask)
    assert ret is not None and torch.allclose(adv, whiten(ret, mask))
    values = torch.full((4, 3), 0.25)
    adv, ret = compute_advantages(AlgoConfig(advantage="gae", whiten_advantages=False), rewards, groups, mask, values)
    assert ret is not None and float(ret[0, 1]) == pytest.approx(1.0)  # gamma = lam = 1: returns = reward
    with pytest.raises(ValueError, match="values_BR"):
        compute_advantages(AlgoConfig(advantage="gae"), rewards, groups, mask)
    kl_reward = AlgoConfig(advantage="gae", kl={"coef": 0.1, "use": "reward"})
    with pytest.raises(ValueError, match="kl_BR"):
        compute_advantages(kl_reward, rewards, groups, mask, values)
    adv_kl, ret_kl = compute_advantages(kl_reward, rewards, groups, mask, values, kl_BR=torch.ones(4, 3))
    assert ret_kl is not None and float(ret_kl[0, 1]) == pytest.approx(0.9)  # the last token's own penalty


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(gamma: float) -> None:
    torch.manual_seed(3)
    mask = (torch.rand(4, 7) > 0.25).float()
    rewards, kl = torch.randn(4), torch.randn(4, 7)
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma, kl_BR=kl, kl_coef=0.05)
    expected = []
    for b in range(4):
        idx = [t for t in range(7) if mask[b, t] > 0]
        row = [0.0] * 7
        running = 0.0
        for k, t in enumerate(reversed(idx)):
            r = -0.05 * float(kl[b, t]) + (float(rewards[b]) if k == 0 else 0.0)
            running = r + gamma * running
            row[t] = running
        expected.append(row)
    assert ret.flatten().tolist() == pytest.approx([x for row in expected for x in row], abs=1e-5)
    flat = [x for row, m in zip(expected, mask.tolist(), strict=True) for x, mm in zip(row, m, strict=True) if mm > 0]
    mean, std = statistics.fmean(flat), statistics.stdev(flat)
    assert adv[mask > 0].tolist() == pytest.approx([(x - mean) / std for x in flat], abs=1e-4)


def test_integer_rewards_give_the_float_advantages() -> None:
    ints, groups = torch.tensor([1, 0, 1, 0]), torch.tensor([0, 0, 1, 1])  # 0/1 correctness as ints
    for estimator in (grpo_advantages, drgrpo_advantages, rloo_advantages):
        got = estimator(ints, groups)
        assert got.dtype == torch.float32
        assert torch.equal(got, estimator(ints.float(), groups))
    assert grpo_advantages(ints, groups).abs().min() > 0.7  # not truncated to integer zeros


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp", "gae"])
def test_every_response_empty(advantage: str) -> None:
    # every prompt hit the context limit before its first turn: the response layout has no columns
    rewards, groups, mask = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), torch.zeros(3, 0)
    values = torch.zeros(3, 0) if advantage == "gae" else None
    adv, _ = compute_advantages(AlgoConfig(advantage=advantage), rewards, groups, mask, values)
    assert adv.shape == (3, 0)
