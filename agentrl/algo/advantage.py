"""Advantage estimators: rewards (one per trajectory) and, for PPO, a critic's values -> per-token advantages.

Inputs follow the response layout the packer gives the trainer (agentrl/learner/packing.py,
`response_layout`): row b is trajectory b, column t its t-th response token, `mask_BR` its loss mask (1 on
model-sampled tokens, 0 on tool observations and padding). Group-relative estimators (GRPO, Dr.GRPO, RLOO,
REINFORCE++-baseline) take `group_ids_B`, any integer labelling the trajectories sampled for one prompt.
Tool-observation tokens are transparent to the per-token estimators: returns and GAE skip over them, so a
reward flows back through a tool call to the tokens that made it. The policy loss (loss.py) consumes the
result; `compute_advantages` picks the estimator an `AlgoConfig` names.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algo import AlgoConfig


def group_stats(values_B: Tensor, group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-trajectory group index, and per-group count, mean and unbiased std (std 0 for a group of one)."""
    _, index_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = int(index_B.max()) + 1 if index_B.numel() else 0
    values_B = values_B.double()  # group sums of many rewards: keep the mean exact to float32 precision
    count_G = torch.bincount(index_B, minlength=num_groups).double()
    mean_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index_B, values_B) / count_G
    sq_G = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index_B, (values_B - mean_G[index_B]) ** 2)
    std_G = (sq_G / (count_G - 1).clamp(min=1)).sqrt()
    return index_B, count_G, mean_G, std_G


def grpo_advantages(rewards_B: Tensor, group_ids_B: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: (r - group mean) / (group std + eps); without std normalisation it is Dr.GRPO's r - mean."""
    index_B, _, mean_G, std_G = group_stats(rewards_B, group_ids_B)
    adv_B = rewards_B.double() - mean_G[index_B]
    if std_normalize:
        adv_B = adv_B / (std_G[index_B] + eps)
    return adv_B.to(_float_dtype(rewards_B))


def drgrpo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """Dr.GRPO (Liu et al. 2025): the group mean is the baseline, with no std division (which favours
    too-easy and too-hard prompts). Pair it with loss_agg=seq_mean_token_sum_norm."""
    return grpo_advantages(rewards_B, group_ids_B, std_normalize=False)


def rloo_advantages(rewards_B: Tensor, group_ids_B: Tensor) -> Tensor:
    """RLOO: r_i minus the mean of the other samples of its group; 0 for a group of one."""
    index_B, count_G, mean_G, _ = group_stats(rewards_B, group_ids_B)
    n_B = count_G[index_B]
    adv_B = (n_B / (n_B - 1).clamp(min=1)) * (rewards_B.double() - mean_G[index_B])
    return adv_B.to(_float_dtype(rewards_B))


def _float_dtype(rewards_B: Tensor) -> torch.dtype:
    """Advantages keep a floating rewards dtype; integer rewards (0/1 correctness) give float32."""
    return rewards_B.dtype if rewards_B.is_floating_point() else torch.float32


def broadcast_to_tokens(values_B: Tensor, mask_BR: Tensor) -> Tensor:
    """One value per trajectory -> the same value on each of its sampled tokens (0 elsewhere)."""
    return values_B[:, None].to(mask_BR.dtype) * mask_BR


def token_rewards(rewards_B: Tensor, mask_BR: Tensor, kl_BR: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """The trajectory's reward on its last sampled token, minus kl_coef * kl on every sampled token."""
    mask_BR = mask_BR.to(torch.float32)
    if mask_BR.shape[1] == 0:  # every response empty (e.g. all prompts hit the context limit): no tokens to reward
        return torch.zeros_like(mask_BR)
    positions_R = torch.arange(1, mask_BR.shape[1] + 1, dtype=torch.float32)
    last_B = (mask_BR * positions_R).argmax(dim=1)
    has_tokens_B = mask_BR.sum(dim=1) > 0
    out_BR = torch.zeros_like(mask_BR)
    out_BR[torch.arange(mask_BR.shape[0]), last_B] = rewards_B.to(torch.float32) * has_tokens_B
    if kl_BR is not None and kl_coef:
        out_BR = out_BR - kl_coef * kl_BR.to(torch.float32) * mask_BR
    return out_BR


def discounted_returns(token_rewards_BR: Tensor, mask_BR: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go over sampled tokens only: G_t = r_t + gamma * G_next, where "next" skips tool tokens."""
    mask_BR = mask_BR.to(torch.float32)
    running_B = torch.zeros(mask_BR.shape[0])
    out_BR = torch.zeros_like(mask_BR)
    for t in range(mask_BR.shape[1] - 1, -1, -1):
        m_B = mask_BR[:, t]
        g_B = token_rewards_BR[:, t] + gamma * running_B
        running_B = torch.where(m_B > 0, g_B, running_B)
        out_BR[:, t] = g_B * m_B
    return out_BR


def whiten(values_BR: Tensor, mask_BR: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries of the whole batch (unbiased variance); 0 where masked out."""
    mask_BR = mask_BR.to(torch.float32)
    n = mask_BR.sum()
    mean = (values_BR * mask_BR).sum() / n.clamp(min=1)
    var = (((values_BR - mean) ** 2) * mask_BR).sum() / (n - 1).clamp(min=1)
    return (values_BR - mean) * torch.rsqrt(var + eps) * mask_BR


def reinforce_pp_advantages(
    rewards_B: Tensor,
    mask_BR: Tensor,
    gamma: float = 1.0,
    kl_BR: Tensor | None = None,
    kl_coef: float = 0.0,
    group_ids_B: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025): per-token returns of the reward minus a KL penalty, normalised over the batch.
    With `group_ids_B` it is REINFORCE++-baseline: the group mean reward is subtracted first.
    Returns (advantages_BR, returns_BR)."""
    if group_ids_B is not None:
        rewards_B = drgrpo_advantages(rewards_B, group_ids_B)
    returns_BR = discounted_returns(token_rewards(rewards_B, mask_BR, kl_BR, kl_coef), mask_BR, gamma)
    return whiten(returns_BR, mask_BR), returns_BR


def gae_advantages(
    token_rewards_BR: Tensor, values_BR: Tensor, mask_BR: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over sampled tokens; the value after the last one is 0 (terminal).
    A tool observation between two turns is skipped: the next state of a turn's last token is the next
    turn's first sampled token. Returns (advantages_BR, returns_BR = advantages + values)."""
    mask_BR = mask_BR.to(torch.float32)
    values_BR = values_BR.to(torch.float32) * mask_BR
    next_value_B = torch.zeros(mask_BR.shape[0])
    last_gae_B = torch.zeros(mask_BR.shape[0])
    adv_BR = torch.zeros_like(mask_BR)
    for t in range(mask_BR.shape[1] - 1, -1, -1):
        m_B = mask_BR[:, t] > 0
        delta_B = token_rewards_BR[:, t] + gamma * next_value_B - values_BR[:, t]
        gae_B = delta_B + gamma * lam * last_gae_B
        last_gae_B = torch.where(m_B, gae_B, last_gae_B)
        next_value_B = torch.where(m_B, values_BR[:, t], next_value_B)
        adv_BR[:, t] = gae_B * m_B
    return adv_BR, (adv_BR + values_BR) * mask_BR


def compute_advantages(
    config: AlgoConfig,
    rewards_B: Tensor,
    group_ids_B: Tensor,
    mask_BR: Tensor,
    values_BR: Tensor | None = None,
    kl_BR: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The estimator `config.advantage` names. Returns (advantages_BR, returns_BR or None); returns are the
    critic's regression target for gae. `kl_BR` (old policy vs reference, per token) is used only when
    config.kl.use == "reward"; `values_BR` only by gae."""
    mask_BR = mask_BR.to(torch.float32)
    kl_coef = config.kl.coef if config.kl.use == "reward" else 0.0
    if kl_coef and kl_BR is None:
        raise ValueError("kl.use=reward needs kl_BR: the reference policy's logprobs were not computed")
    name = config.advantage
    if name in ("grpo", "drgrpo"):
        std = config.std_normalize and name == "grpo"
        return broadcast_to_tokens(grpo_advantages(rewards_B, group_ids_B, std), mask_BR), None
    if name == "rloo":
        return broadcast_to_tokens(rloo_advantages(rewards_B, group_ids_B), mask_BR), None
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        groups = group_ids_B if name == "reinforce_pp_baseline" else None
        return reinforce_pp_advantages(rewards_B, mask_BR, config.gamma, kl_BR, kl_coef, groups)
    if values_BR is None:
        raise ValueError("advantage=gae needs the critic's values_BR")
    adv_BR, returns_BR = gae_advantages(
        token_rewards(rewards_B, mask_BR, kl_BR, kl_coef), values_BR, mask_BR, config.gamma, config.lam
    )
    return (whiten(adv_BR, mask_BR) if config.whiten_advantages else adv_BR), returns_BR
