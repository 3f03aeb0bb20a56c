"""Per-token losses and how they are aggregated: PPO clip (asymmetric, dual), GSPO's sequence ratio, KL,
entropy, value, and the importance weights against the policy that sampled.

Every function is elementwise over tokens (any shape) except the aggregation, which needs to know which
sequence a token belongs to. Aggregation is expressed as per-token weights (`aggregation_weights`) so that
a loss summed micro-batch by micro-batch and rank by rank (agentrl/learner/policy.py) equals the loss of
the whole batch: the normalisers (token count, sequence count) are those of the whole batch, computed by
the packer (agentrl/learner/packing.py). `aggregate` is the padded [B, T] form of the same thing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl.algo import KLEstimator, LossAgg, TISRule

# exp() of a log-ratio past this is inf in float32; the clip makes such tokens constant anyway
_MAX_LOG_RATIO = 20.0


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), where
    r = exp(logprobs - old_logprobs). clip_high > clip_low is DAPO's clip-higher. With `dual_clip` = c
    (Ye et al. 2020), tokens with A < 0 are further capped at -A c so one huge ratio cannot dominate.
    Returns (loss, clipped): `clipped` is 1.0 where a clip bound decided the loss (for clip fractions)."""
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped.to(logprobs.dtype)


def gspo_logprobs(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """GSPO (Zheng et al. 2025), token form: per-token logprobs whose ratio to `old_logprobs` is the
    sequence's, s_i = exp(mean over its sampled tokens of (logprobs - old_logprobs)), on every token of the
    sequence, while each token's gradient stays its own (s_i times the gradient of its logprob). Feed the
    result to `ppo_clip_loss` in place of `logprobs`: the clip then acts on s_i (GSPO's clip ranges are
    small, e.g. 3e-4 / 4e-4). `seq_index` gives each token's sequence (0..num_seqs-1); `mask` its weight."""
    log_ratio = (logprobs - old_logprobs).detach() * mask
    sums = torch.zeros(num_seqs, dtype=log_ratio.dtype, device=log_ratio.device).index_add_(0, seq_index, log_ratio)
    counts = torch.zeros(num_seqs, dtype=mask.dtype, device=mask.device).index_add_(0, seq_index, mask)
    seq_log_ratio = (sums / counts.clamp(min=1e-12))[seq_index]
    return old_logprobs + seq_log_ratio + (logprobs - logprobs.detach())


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).
    k1 = log r; k2 = (log r)^2 / 2; k3 = exp(-log r) - 1 + log r, with log r = logprobs - ref_logprobs.
    k3 is unbiased and always >= 0; it is clamped to [-10, 10] (as veRL's low_var_kl) because exp() of a
    large negative log-ratio explodes on the rare token the reference finds far likelier."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(max=_MAX_LOG_RATIO)
    return (torch.exp(neg) - 1.0 - neg).clamp(-10.0, 10.0)


def behaviour_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float,
                      rule: TISRule = "truncate") -> Tensor:
    """Per-token weights w = pi_proximal / pi_behaviour of the policy loss, detached, bounded at `cap` by
    `rule`: "truncate" gives min(w, cap) (truncated importance sampling, Yao et al. 2025: every token keeps
    a bounded weight); "mask" gives w where w <= cap and 0 above it (AReaL's decoupled objective: a token
    the behaviour policy found far less likely than the proximal one leaves the loss). The proximal
    logprobs are the learner's before the step; the behaviour ones are the engine's, which sampled (its
    numerics, and stale weights in asynchronous training)."""
    w = torch.exp((proximal_logprobs - behaviour_logprobs).clamp(max=_MAX_LOG_RATIO)).detach()
    return w.clamp(max=cap) if rule == "truncate" else torch.where(w <= cap, w, 0.0)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None = 0.2) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss, per token: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).
    Returns (loss, clipped) with `clipped` 1.0 where the clipped branch was larger."""
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(values)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def masked_sum(values: Tensor, weights: Tensor) -> Tensor:
    """sum(weights * values), where tokens of weight 0 contribute exactly 0 even if their value is inf/NaN
    (e.g. a prompt position's logprob of an arbitrary target)."""
    return (values.masked_fill(weights == 0, 0.0) * weights).sum()


def aggregation_weights(
    mask_T: Tensor,
    seq_index_T: Tensor,
    local_sequences: int,
    mode: LossAgg,
    num_tokens: int,
    num_sequences: int,
    norm_tokens: int | None = None,
) -> Tensor:
    """Per-token weights w such that sum(w * loss) is the batch loss under `mode`:

    - token_mean: every sampled token of the batch counts once: mask / num_tokens.
    - seq_mean_token_mean: mean over sequences of each sequence's token mean: mask / (n_i * num_sequences).
    - seq_mean_token_sum_norm (Dr.GRPO): mean over sequences of each token sum divided by a constant:
      mask / (norm_tokens * num_sequences); no dependence on a sequence's own length.

    `num_tokens` and `num_sequences` count the sampled tokens and the sequences with at least one of them in
    the whole batch (all micro-batches, all ranks). `seq_index_T` labels the sequences of these tokens
    0 .. local_sequences - 1 (a count known on the host, so no device sync); a sequence must lie wholly
    inside them (the packer never splits one), so n_i is counted here."""
    mask_T = mask_T.to(torch.float32)
    if mode == "token_mean":
        return mask_T / max(num_tokens, 1)
    if mode == "seq_mean_token_mean":
        seq_tokens = torch.zeros(local_sequences, device=mask_T.device)
        seq_tokens.index_add_(0, seq_index_T, mask_T)
        return mask_T / (seq_tokens[seq_index_T].clamp(min=1) * max(num_sequences, 1))
    if norm_tokens is None:
        raise ValueError("loss_agg seq_mean_token_sum_norm needs algo.loss_norm_tokens, Dr.GRPO's constant (a run "
                         "config sets it to task.budgets.max_response_tokens)")
    return mask_T / (norm_tokens * max(num_sequences, 1))


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: LossAgg, norm_tokens: int | None = None) -> Tensor:
    """The padded form: row b is one sequence. Equals `(aggregation_weights(...) * loss).sum()` with the
    batch's own counts; `norm_tokens` defaults to the row length T."""
    mask_BT = mask_BT.to(torch.float32)
    seq_index_BT = torch.arange(mask_BT.shape[0], device=mask_BT.device)[:, None].expand_as(mask_BT)
    num_sequences = int((mask_BT.sum(dim=1) > 0).sum())
    weights = aggregation_weights(
        mask_BT.flatten(), seq_index_BT.flatten(), mask_BT.shape[0], mode, int(mask_BT.sum()), num_sequences,
        norm_tokens if norm_tokens is not None else mask_BT.shape[1],
    )
    return (weights * loss_BT.flatten()).sum()
