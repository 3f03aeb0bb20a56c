"""Scored groups -> the learner's packed batches, in one fixed order.

1. Leave out errored trajectories (their tool's service failed), then flatten the groups (algo/sampling.py):
   trajectories, rewards, group ids.
2. Shape and filter: DAPO's overlong penalty on the rewards; rows dropped from the loss (a 0 row scale,
   never a rebuilt mask): truncated trajectories (overlong filtering) and, as SimpleTIR does, those with a
   void turn (a model turn whose own text holds neither a tool call nor a final answer, a turn cut by a
   length limit included; the rollout counts them).
3. Split the groups into the step's mini-batches and pack each once (learner/packing.py).
4. The learner's logprobs before the step (old: the proximal policy of the decoupled objective), the
   reference's, the critic's values, mini-batch by mini-batch, assembled in the response layout [B, R].
   The old-logprobs pass runs only where the step's one forward cannot stand in for it: with one
   optimizer step (one PPO epoch of one mini-batch) the weights before the step are the weights of the
   training forward, so the policy takes them from there, detached (learner/policy.py), and the pass's
   forward over the whole batch is saved. A reference in the reward (kl.use=reward) still needs them here;
   one in the loss does not (its KL is taken on the training forward's logprobs).
5. Advantages over the whole step (algo/advantage.py), then `Batch.set` on every mini-batch; each
   trajectory keeps its mean advantage and, where step 4 computed them, the learner's logprobs (for dumps).

The trainer calls `build_batch` once per step and hands the mini-batches to the learner.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agentrl.algo import AlgoConfig
from agentrl.algo.advantage import compute_advantages
from agentrl.algo.loss import kl_penalty
from agentrl.algo.sampling import flatten_groups, keep_untruncated, overlong_penalty, without_errored
from agentrl.learner.packing import Batch, pack, response_layout
from agentrl.types import Group, Trajectory


@dataclass
class StepBatch:
    mini_batches: list[Batch]
    trajectories: list[Trajectory]
    metrics: dict[str, float]


def has_void_turn(t: Trajectory) -> bool:
    """Whether a model turn of `t` was void: judged turn by turn, on that turn's text, as the rollout went
    (rollout.py, `ToolFormat.is_void`), so an answer in another turn does not excuse it."""
    if "void_turns" not in t.timings:
        raise ValueError(f"trajectory {t.prompt.id}/{t.sample} has no timings['void_turns']: drop_void_turns reads "
                         "the count of void turns that rollout.py records; expected a trajectory from the rollout")
    return t.timings["void_turns"] > 0


def shape_and_filter(trajectories: Sequence[Trajectory], rewards_B: Tensor, response_lens_B: Tensor, *,
                     algo: AlgoConfig, drop_void_turns: bool,
                     metrics: dict[str, float]) -> tuple[Tensor, Tensor]:
    """Stage 2: the rewards with DAPO's overlong penalty, and the row scale [B] (0: dropped from the loss)
    of truncated trajectories (overlong filtering) and, with `drop_void_turns`, of those with a void turn.
    Records what it did in `metrics`."""
    overlong = algo.overlong
    if overlong.max_tokens is not None:
        rewards_B = rewards_B + overlong_penalty(response_lens_B, overlong.max_tokens, overlong.buffer_tokens,
                                                 overlong.penalty)
        metrics["reward/shaped_mean"] = float(rewards_B.mean())
    scale_B = torch.ones(len(trajectories))
    if overlong.filter_truncated:
        kept = keep_untruncated(trajectories)
        metrics["batch/truncated_dropped"] = float((kept == 0).sum())
        scale_B = scale_B * kept
    if drop_void_turns:
        void = torch.tensor([0.0 if has_void_turn(t) else 1.0 for t in trajectories])
        metrics["batch/void_dropped"] = float((void == 0).sum())
        scale_B = scale_B * void
    return rewards_B, scale_B


def split_groups(groups: Sequence[Group], parts: int) -> list[list[int]]:
    """Row indices of `parts` mini-batches of whole groups, in order, as even as the groups allow."""
    parts = min(parts, len(groups))
    bounds = [round(i * len(groups) / parts) for i in range(parts + 1)]
    starts = [0, *itertools.accumulate(len(g.trajectories) for g in groups)]  # first row of each group
    return [list(range(starts[a], starts[b])) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _keep_for_dumps(trajectories: Sequence[Trajectory], advantages_BR: Tensor, mask_BR: Tensor,
                    old_BR: Tensor | None) -> None:
    """Each trajectory's mean advantage over its trained tokens, and the learner's logprobs where the step
    computed them, kept on it for the step's dumps (samples.py)."""
    for i, t in enumerate(trajectories):
        trained = mask_BR[i]
        t.learner = {"advantage": float((advantages_BR[i] * trained).sum() / trained.sum().clamp(min=1))}
        if old_BR is not None:
            t.learner["logprobs"] = old_BR[i, : len(t.response_ids)].tolist()


def build_batch(groups: Sequence[Group], *, algo: AlgoConfig, token_budget: int, mini_batches: int, policy: Any,
                reference: Any = None, critic: Any = None, drop_void_turns: bool = False,
                ppo_epochs: int = 1) -> StepBatch:
    groups = without_errored(groups)
    trajectories, rewards_B, group_ids_B = flatten_groups(groups)
    layout = response_layout(trajectories)
    metrics = {"reward/mean": float(rewards_B.mean())}
    for part in sorted({k for t in trajectories if t.reward for k in t.reward.parts}):
        metrics[f"reward/{part}"] = sum(t.reward.parts.get(part, 0.0) for t in trajectories if t.reward) / len(trajectories)

    rewards_B, scale_B = shape_and_filter(trajectories, rewards_B, layout.response_lens_B, algo=algo,
                                          drop_void_turns=drop_void_turns, metrics=metrics)

    world, rank = policy.ctx.world_size, policy.ctx.rank
    parts = split_groups(groups, mini_batches)
    batches = [pack([trajectories[i] for i in rows], token_budget, world, scale_B[rows])[rank] for rows in parts]

    def assemble(compute: Any) -> Tensor:
        out_BR = torch.zeros_like(layout.mask_BR)
        for rows, b in zip(parts, batches, strict=True):
            out_BR[rows, : b.max_response_len] = compute(b)
        return out_BR

    mask_BR = layout.mask_BR * scale_B[:, None]
    ref_BR = assemble(reference.compute_logprobs) if reference is not None else None
    one_step = ppo_epochs == 1 and len(batches) == 1
    # a reference in the loss needs no old logprobs (its KL is the training forward's against it)
    kl_in_reward = ref_BR is not None and algo.kl.use == "reward"
    needs_old = (algo.off_policy == "decoupled" and not one_step) or kl_in_reward
    old_BR = assemble(policy.compute_logprobs) if needs_old else None
    values_BR = assemble(critic.compute_values) if critic is not None else None
    kl_BR = kl_penalty(old_BR, ref_BR, algo.kl.estimator) * layout.mask_BR if kl_in_reward else None
    advantages_BR, returns_BR = compute_advantages(algo, rewards_B, group_ids_B, mask_BR, values_BR, kl_BR)

    for rows, b in zip(parts, batches, strict=True):
        width = b.max_response_len
        b.set("advantages", advantages_BR[rows, :width])
        proximal_BR = old_BR if algo.off_policy == "decoupled" else layout.engine_logprobs_BR
        if proximal_BR is not None:  # None: the training forward's own logprobs, detached
            b.set("old_logprobs", proximal_BR[rows, :width])
        if ref_BR is not None:
            b.set("ref_logprobs", ref_BR[rows, :width])
        if values_BR is not None and returns_BR is not None:
            b.set("old_values", values_BR[rows, :width])
            b.set("returns", returns_BR[rows, :width])

    _keep_for_dumps(trajectories, advantages_BR, mask_BR, old_BR)

    tokens = layout.mask_BR.sum().clamp(min=1)
    metrics |= {
        "batch/trajectories": float(len(trajectories)),
        "batch/mini_batches": float(len(batches)),
        "batch/loss_tokens": float(mask_BR.sum()),
        "batch/advantage_mean": float((advantages_BR * mask_BR).sum() / mask_BR.sum().clamp(min=1)),
    }
    if kl_BR is not None:
        metrics["actor/ref_kl"] = float(kl_BR.sum() / tokens)
    return StepBatch(batches, trajectories, metrics)
