"""Losses and aggregation (agentrl/algo/loss.py) against hand-computed numbers and plain loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import (
    aggregate,
    aggregation_weights,
    behaviour_weights,
    kl_penalty,
    masked_sum,
    ppo_clip_loss,
    value_loss,
)


def test_ppo_clip_golden() -> None:
    old = torch.zeros(5)
    logprobs = torch.tensor([0.5, -0.5, -0.5, 2.0, 0.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    loss, clipped = ppo_clip_loss(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    e = math.exp
    # a: ratio e^.5 > 1.28, A > 0 -> clipped -1.28; b: ratio e^-.5 < .8, A > 0 -> unclipped -e^-.5
    # c: A < 0, ratio < .8 -> clipped 0.8; d: A < 0, ratio e^2 -> unclipped e^2; e: ratio 1 -> -A
    assert loss.tolist() == pytest.approx([-1.28, -e(-0.5), 0.8, e(2.0), -2.0], abs=1e-6)
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    loss_d, clipped_d = ppo_clip_loss(logprobs, old, adv, 0.2, 0.28, dual_clip=3.0)
    assert loss_d.tolist() == pytest.approx([-1.28, -e(-0.5), 0.8, 3.0, -2.0], abs=1e-6)  # d capped at -A * 3
    assert clipped_d.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]


def _ppo_loop(lp: float, old: float, a: float, lo: float, hi: float, c: float | None) -> float:
    r = math.exp(lp - old)
    loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clip_matches_loop(dual: float | None) -> None:
    torch.manual_seed(1)
    lp, old, adv = torch.randn(200) * 0.5, torch.randn(200) * 0.5, torch.randn(200)
    loss, _ = ppo_clip_loss(lp, old, adv, 0.2, 0.28, dual)
    expected = [_ppo_loop(*xs, 0.2, 0.28, dual) for xs in zip(lp.tolist(), old.tolist(), adv.tolist(), strict=True)]
    assert loss.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_ppo_clip_gradient_is_zero_when_clipped() -> None:
    lp = torch.tensor([0.5, 0.0], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.zeros(2), torch.tensor([1.0, 1.0]))
    loss.sum().backward()
    assert lp.grad is not None and lp.grad.tolist() == pytest.approx([0.0, -1.0])


def test_kl_estimators_golden() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0])
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([1.0, -1.0])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5, 0.5])
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([math.exp(-1), math.e - 2], abs=1e-6)
    assert float(kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), "k3")) == 10.0  # clamped


def test_kl_k3_is_unbiased_and_k1_gradient() -> None:
    # E_pi[k3] = KL(pi || ref) for categorical pi, ref: check by exact expectation
    pi = torch.tensor([0.5, 0.3, 0.2])
    ref = torch.tensor([0.2, 0.5, 0.3])
    kl = float((pi * (pi / ref).log()).sum())
    k3 = kl_penalty(pi.log(), ref.log(), "k3")
    k1 = kl_penalty(pi.log(), ref.log(), "k1")
    assert float((pi * k3).sum()) == pytest.approx(kl, abs=1e-6)
    assert float((pi * k1).sum()) == pytest.approx(kl, abs=1e-6)


def test_as_a_reward_k1_gives_the_kls_gradient_and_k3_does_not() -> None:
    """A KL penalty in the reward is differentiated through the score function, E_pi[k(y) grad log pi(y)]:
    that is grad KL(pi || ref) for k1 and not for k3. In the loss k3 is differentiated directly, which gives
    the gradient of KL(ref || pi), a pull towards the reference, from a never-negative, low-variance value.
    Hence the defaults: k1 for kl.use=reward, k3 for kl.use=loss."""
    logits = torch.tensor([0.3, -0.2, 0.9, 0.1], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.4, -0.3, 0.2]), dim=0)
    logpi = torch.log_softmax(logits, dim=0)
    pi = logpi.exp()
    (grad_kl,) = torch.autograd.grad((pi * (logpi - ref)).sum(), logits, retain_graph=True)

    def score_function_grad(estimator: str) -> torch.Tensor:
        penalty = kl_penalty(logpi, ref, estimator).detach()
        return torch.autograd.grad((pi.detach() * penalty * logpi).sum(), logits, retain_graph=True)[0]

    assert torch.allclose(score_function_grad("k1"), grad_kl, atol=1e-6)
    assert (score_function_grad("k3") - grad_kl).abs().max() > 0.05
    # differentiated directly (the loss), k3 over pi's samples gives grad KL(ref || pi): it pulls pi to ref
    (grad_k3_loss,) = torch.autograd.grad((pi.detach() * kl_penalty(logpi, ref, "k3")).sum(), logits, retain_graph=True)
    (grad_reverse,) = torch.autograd.grad((ref.exp() * (ref - logpi)).sum(), logits)
    assert torch.allclose(grad_k3_loss, grad_reverse, atol=1e-6)
    assert AlgoConfig(advantage="gae", kl={"coef": 0.1, "use": "reward"}).kl.estimator == "k1"
    assert AlgoConfig(kl={"coef": 0.1}).kl.estimator == "k3"
    assert AlgoConfig(advantage="gae", kl={"coef": 0.1, "use": "reward", "estimator": "k3"}).kl.estimator == "k3"
    assert AlgoConfig(kl={"coef": 0.1, "estimator": "k2"}).kl.estimator == "k2"


def test_behaviour_weights_truncate_or_mask() -> None:
    proximal, behaviour = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.5, -0.5, -1.2])  # w = e^.5, e^-.5, e^.2
    w = behaviour_weights(proximal, behaviour, cap=1.5)
    assert w.tolist() == pytest.approx([1.5, math.exp(-0.5), math.exp(0.2)])  # truncated at the cap
    masked = behaviour_weights(proximal, behaviour, cap=1.5, rule="mask")
    assert masked.tolist() == pytest.approx([0.0, math.exp(-0.5), math.exp(0.2)])  # above the cap: out of the loss
    lp = torch.tensor([-1.0], requires_grad=True)
    assert not behaviour_weights(lp, torch.tensor([-1.0]), 2.0).requires_grad
    assert not behaviour_weights(lp, torch.tensor([-1.0]), 2.0, "mask").requires_grad


def test_value_loss_golden() -> None:
    loss, clipped = value_loss(torch.tensor([1.0, 0.6]), torch.tensor([0.5, 0.5]), torch.tensor([2.0, 0.55]), clip=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped value 0.7 -> 1.69; token 1 inside the range
    assert loss.tolist() == pytest.approx([0.845, 0.5 * 0.05**2])
    assert clipped.tolist() == [1.0, 0.0]
    plain, _ = value_loss(torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([2.0]), clip=None)
    assert plain.tolist() == [0.5]


def test_aggregate_golden() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 2: no tokens
    assert float(aggregate(loss, mask, "token_mean")) == pytest.approx(2.5)
    assert float(aggregate(loss, mask, "seq_mean_token_mean")) == pytest.approx(3.0)
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm")) == pytest.approx((6 / 4 + 4 / 4) / 2)
    assert float(aggregate(loss, mask, "seq_mean_token_sum_norm", norm_tokens=10)) == pytest.approx(0.5)


def _aggregate_loop(loss: list[list[float]], mask: list[list[float]], mode: str, norm: int) -> float:
    rows = [(sum(x * m for x, m in zip(lr, mr, strict=True)), sum(mr)) for lr, mr in zip(loss, mask, strict=True)]
    rows = [(s, n) for s, n in rows if n > 0]
    if mode == "token_mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if mode == "seq_mean_token_mean":
        return sum(s / n for s, n in rows) / len(rows)
    return sum(s / norm for s, _ in rows) / len(rows)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregate_matches_loop_and_splits_exactly(mode: str) -> None:
    rng = random.Random(3)
    loss = [[rng.uniform(-2, 2) for _ in range(7)] for _ in range(6)]
    mask = [[float(rng.random() < 0.6) for _ in range(7)] for _ in range(6)]
    mask[4] = [0.0] * 7
    loss_t, mask_t = torch.tensor(loss), torch.tensor(mask)
    total = float(aggregate(loss_t, mask_t, mode, norm_tokens=7))
    assert total == pytest.approx(_aggregate_loop(loss, mask, mode, 7), rel=1e-5)
    # the same batch in two "micro-batches" with whole-batch counts sums to the same loss
    n_tokens, n_seqs = int(mask_t.sum()), int((mask_t.sum(1) > 0).sum())
    parts = 0.0
    for rows in ([0, 3, 5], [1, 2, 4]):
        m = mask_t[rows].flatten()
        seq_index = torch.arange(len(rows))[:, None].expand(len(rows), 7).flatten()
        w = aggregation_weights(m, seq_index, len(rows), mode, n_tokens, n_seqs, 7)
        parts += float((w * loss_t[rows].flatten()).sum())
    assert parts == pytest.approx(total, rel=1e-5)


def test_masked_sum_ignores_zero_weight_tokens() -> None:
    values = torch.tensor([float("nan"), 2.0, float("-inf"), 4.0], requires_grad=True)
    weights = torch.tensor([0.0, 0.5, 0.0, 0.25])
    total = masked_sum(values, weights)
    assert float(total.detach()) == 2.0
    total.backward()
    assert values.grad is not None and values.grad.tolist() == [0.0, 0.5, 0.0, 0.25]


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop(clip: float | None) -> None:
    torch.manual_seed(2)
    v, old, ret = torch.randn(100), torch.randn(100), torch.randn(100)
    loss, _ = value_loss(v, old, ret, clip)
    expected = []
    for vi, oi, ri in zip(v.tolist(), old.tolist(), ret.tolist(), strict=True):
        unclipped = (vi - ri) ** 2
        clipped = (oi + min(max(vi - oi, -clip), clip) - ri) ** 2 if clip is not None else unclipped
        expected.append(0.5 * max(unclipped, clipped))
    assert loss.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_gspo_ratio_is_the_sequences_and_the_gradient_each_tokens() -> None:
    from agentrl.algo.loss import gspo_logprobs

    # sequence 0: two sampled tokens with log-ratios +0.5 and -0.5 (geometric mean 1); sequence 1: one sampled
    # token with log-ratio +0.5, and a prompt/tool position (mask 0) whose ratio must not count
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.5, -1.5, -1.0, 0.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    out = gspo_logprobs(logprobs, old, mask, seq, 2)
    ratio = torch.exp(out - old)
    assert torch.allclose(ratio, torch.tensor([1.0, 1.0, math.exp(0.5), math.exp(0.5)]))
    (ratio * mask).sum().backward()
    assert torch.allclose(logprobs.grad, torch.tensor([1.0, 1.0, math.exp(0.5), 0.0]))  # s_i x each token's own
    loss, clipped = ppo_clip_loss(out.detach(), old, torch.ones(4), clip_low=3e-4, clip_high=4e-4)
    assert clipped.tolist() == [0.0, 0.0, 1.0, 1.0]  # clipped by the sequence's ratio, not the token's
