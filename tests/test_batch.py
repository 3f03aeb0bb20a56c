"""build_batch (agentrl/batch.py) with a real tiny policy: when the learner's old-logprobs pass runs, and that
one optimizer step without it (the proximal policy taken from the training forward) updates the weights as
the step with it does; and which trajectories `drop_void_turns` drops (has_void_turn)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.batch import build_batch, has_void_turn
from agentrl.learner.config import LearnerConfig, OptimConfig
from agentrl.learner.packing import response_layout
from agentrl.learner.policy import PolicyWorker
from agentrl.learner.reference import ReferenceWorker
from agentrl.types import Group, RewardResult, StopReason
from tests.learner_util import padded_logprobs, tiny_lm, trajectories


def _groups(n: int = 8, group_size: int = 2) -> list[Group]:
    trajs = trajectories(n, seed=5, group_size=group_size)
    return [Group(trajs[i].prompt, trajs[i:i + group_size]) for i in range(0, n, group_size)]


def _policy(algo: AlgoConfig) -> tuple[PolicyWorker, list[int]]:
    """A tiny policy whose compute_logprobs calls are counted."""
    config = LearnerConfig(device="cpu", token_budget=400, optim=OptimConfig(lr=1e-2, weight_decay=0.0))
    worker = PolicyWorker(config, algo, model=tiny_lm(seed=4))
    calls: list[int] = []
    inner = worker.compute_logprobs

    def counted(batch):
        calls.append(1)
        return inner(batch)

    worker.compute_logprobs = counted
    return worker, calls


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


@pytest.mark.parametrize("tis_cap", [2.0, None])
def test_one_optimizer_step_takes_the_proximal_policy_from_its_forward(tis_cap) -> None:
    algo = AlgoConfig(tis_cap=tis_cap)
    groups = _groups()
    trajs = [t for g in groups for t in g.trajectories]
    layout = response_layout(trajs)
    fast, fast_calls = _policy(algo)
    with_pass, pass_calls = _policy(algo)
    # the proximal logprobs by a plain HF forward: the gap to the engine's (here random) logprobs is known
    with torch.no_grad():
        learner_BR, _ = padded_logprobs(tiny_lm(seed=4), trajs)
    expected_gap = float(((learner_BR - layout.engine_logprobs_BR).abs() * layout.mask_BR).sum() / layout.mask_BR.sum())

    one = build_batch(groups, algo=algo, token_budget=400, mini_batches=1, policy=fast)
    assert fast_calls == []  # no old-logprobs pass
    [batch] = one.mini_batches
    assert all(mb.old_logprobs_T is None for mb in batch.micro_batches)
    # two epochs need the pass (the second one's weights are not the first one's); train its first step only
    two = build_batch(groups, algo=algo, token_budget=400, mini_batches=1, policy=with_pass, ppo_epochs=2)
    assert len(pass_calls) == 1
    [reference_batch] = two.mini_batches

    m_fast, m_pass = fast.train_step(batch), with_pass.train_step(reference_batch)
    assert m_fast["actor/logprob_gap"] == pytest.approx(expected_gap, rel=1e-4)
    expected_nll = float(-(learner_BR * layout.mask_BR).sum() / layout.mask_BR.sum())
    assert m_fast["actor/nll"] == pytest.approx(expected_nll, rel=1e-4)
    for key in ("actor/loss", "actor/pg_loss", "actor/logprob_gap", "actor/nll", "actor/engine_kl", "actor/grad_norm",
                *(["actor/tis_weight"] if tis_cap else [])):
        assert m_fast[key] == pytest.approx(m_pass[key], rel=1e-4, abs=1e-7), key
    assert m_fast["actor/clip_frac"] == m_pass["actor/clip_frac"] == 0.0  # ratio 1 on the step's one forward
    moved = 0.0
    for (name, a), b, before in zip(fast.lm.named_parameters(), with_pass.lm.parameters(),
                                    tiny_lm(seed=4).parameters(), strict=True):
        a, b = _full(a), _full(b)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
        moved = max(moved, float((a - before.detach()).abs().max()))
    assert moved > 1e-4  # the step did move the weights


def test_the_pass_runs_where_the_step_needs_it() -> None:
    groups = _groups()
    decoupled, calls = _policy(AlgoConfig())
    build_batch(groups, algo=AlgoConfig(), token_budget=400, mini_batches=2, policy=decoupled)
    assert len(calls) == 2  # one per mini-batch: the second one trains on moved weights

    behaviour_algo = AlgoConfig(off_policy="behaviour")
    behaviour, calls = _policy(behaviour_algo)
    step = build_batch(groups, algo=behaviour_algo, token_budget=400, mini_batches=2, policy=behaviour, ppo_epochs=2)
    assert calls == []  # the ratio's denominator is the engine's
    engine_BR = response_layout([t for g in groups for t in g.trajectories]).engine_logprobs_BR
    for rows, batch in zip([[0, 1, 2, 3], [4, 5, 6, 7]], step.mini_batches, strict=True):
        expected = engine_BR[rows, : batch.max_response_len]
        assert torch.equal(batch.gather([mb.old_logprobs_T for mb in batch.micro_batches]), expected)

    kl_algo = AlgoConfig(advantage="reinforce_pp", kl={"coef": 0.1, "use": "reward"})
    with_reference, calls = _policy(kl_algo)
    reference = ReferenceWorker(LearnerConfig(device="cpu", token_budget=400), model=tiny_lm(seed=4))
    step = build_batch(groups, algo=kl_algo, token_budget=400, mini_batches=1, policy=with_reference,
                       reference=reference)
    assert len(calls) == 1  # the reward's KL is old policy against the reference, before the step
    assert step.metrics["actor/ref_kl"] == pytest.approx(0.0, abs=1e-6)  # the same weights

    loss_algo = AlgoConfig(kl={"coef": 0.1, "use": "loss"})
    kl_in_loss, calls = _policy(loss_algo)
    step = build_batch(groups, algo=loss_algo, token_budget=400, mini_batches=1, policy=kl_in_loss,
                       reference=reference)
    assert calls == []  # a reference in the loss alone: the step's own forward is the proximal policy
    [batch] = step.mini_batches
    assert all(mb.ref_logprobs_T is not None and mb.old_logprobs_T is None for mb in batch.micro_batches)
    assert "actor/kl_loss" in kl_in_loss.train_step(batch)


def test_a_void_turn_is_the_rollout_s_per_turn_count() -> None:
    """has_void_turn reads how many turns the rollout judged void (SimpleTIR's rule, rollout.py); neither the
    stop reason nor an answer anywhere in the response decides it."""
    [t] = trajectories(1)
    answered = RewardResult(1.0, {"has_answer": 1.0})
    assert has_void_turn(dataclasses.replace(t, stop_reason=StopReason.EOS, reward=answered,
                                             timings={"invalid_turns": 0.0, "void_turns": 1.0}))
    assert has_void_turn(dataclasses.replace(t, stop_reason=StopReason.TURN_LENGTH, reward=answered,
                                             timings={"invalid_turns": 0.0, "void_turns": 1.0}))
    # ended on EOS with no answer, after a turn whose tool call did not parse: each turn still held a call
    unanswered = RewardResult(0.0, {"has_answer": 0.0})
    assert not has_void_turn(dataclasses.replace(t, stop_reason=StopReason.EOS, reward=unanswered,
                                                 timings={"invalid_turns": 1.0, "void_turns": 0.0}))
    with pytest.raises(ValueError, match="void_turns"):
        has_void_turn(dataclasses.replace(t, timings={}))


def test_errored_trajectories_are_out_of_the_loss_and_their_groups_statistics() -> None:
    groups = _groups(n=8, group_size=4)
    for g, scores in zip(groups, ([1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]), strict=True):
        g.trajectories = [dataclasses.replace(t, reward=RewardResult(s)) for t, s in zip(g.trajectories, scores, strict=True)]
    groups[0].trajectories[0] = dataclasses.replace(groups[0].trajectories[0], error="tool")  # its sandbox was down
    algo = AlgoConfig()
    step = build_batch(groups, algo=algo, token_budget=400, mini_batches=1, policy=_policy(algo)[0])
    by_hand = build_batch([Group(g.prompt, [t for t in g.trajectories if t.error is None]) for g in groups], algo=algo,
                          token_budget=400, mini_batches=1, policy=_policy(algo)[0])
    assert step.metrics["batch/trajectories"] == 7.0 and all(t.error is None for t in step.trajectories)
    [batch], [expected] = step.mini_batches, by_hand.mini_batches
    advantages_BR = batch.gather([mb.advantages_T for mb in batch.micro_batches])
    assert torch.equal(advantages_BR, expected.gather([mb.advantages_T for mb in expected.micro_batches]))
    assert not advantages_BR[:3].any()  # group 0 without its errored 1.0: all 0.0, no signal; not -0.25 each
