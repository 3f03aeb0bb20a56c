"""The RL algorithm: advantages, losses and group sampling as pure tensor functions, and their config.

advantage.py turns rewards (and a critic's values) into per-token advantages; loss.py holds the policy,
KL, entropy and value losses and how they are aggregated over tokens; sampling.py filters and refills
groups (DAPO dynamic sampling) and shapes over-long responses. The learner (agentrl/learner/) calls these
on packed tensors; the trainer reads `AlgoConfig` to pick among them. Nothing here touches a model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agentrl.config import StrictModel

AdvantageName = Literal["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
TISRule = Literal["truncate", "mask"]


class KLConfig(StrictModel):
    """KL to the reference policy: a loss term (GRPO) or a per-token reward penalty (PPO, REINFORCE++).

    The estimator's default follows its use. In the reward the policy gradient treats the penalty as a
    return, so what is estimated must be log(pi/pi_ref) itself: k1's score-function gradient is the KL's,
    k3's is not (its expectation is the KL, but E[k3 * grad log pi] is not grad KL). In the loss the
    estimator is differentiated directly: k3 (GRPO's, veRL's low_var_kl) then gives the gradient of
    KL(ref || pi), a pull towards the reference, from a value that is never negative and of low variance."""

    coef: float = Field(0.0, ge=0.0, description="0 turns the KL term off (no reference model is needed)")
    estimator: KLEstimator | None = Field(None, description="k1, k2 or k3; unset: k1 in the reward, k3 in the loss")
    use: Literal["loss", "reward"] = "loss"

    @model_validator(mode="after")
    def _estimator_by_use(self) -> KLConfig:
        if self.estimator is None:
            object.__setattr__(self, "estimator", "k1" if self.use == "reward" else "k3")
        return self


class DynamicSamplingConfig(StrictModel):
    """DAPO dynamic sampling: drop groups whose rewards are all equal, generate more until the batch fills."""

    enabled: bool = False
    max_rounds: int = Field(4, ge=1, description="a step gives up after seeing this many steps' worth of groups "
                            "without enough informative ones, and trains on the first it saw")


class OverlongConfig(StrictModel):
    """DAPO overlong reward shaping (soft punishment inside the last `buffer_tokens` of the budget) and
    overlong filtering (truncated trajectories contribute no loss)."""

    max_tokens: int | None = Field(None, ge=1, description="response budget L_max the penalty is measured against; "
                                   "a run config derives it from the task's budgets.max_response_tokens")
    buffer_tokens: int = Field(0, ge=0, description="L_cache; 0 turns the soft punishment off")
    penalty: float = Field(1.0, ge=0.0, description="the penalty at (and past) L_max")
    filter_truncated: bool = False

    @model_validator(mode="after")
    def _needs_budget(self) -> OverlongConfig:
        if self.max_tokens is not None and self.buffer_tokens > self.max_tokens:
            raise ValueError("overlong.buffer_tokens must not exceed overlong.max_tokens")
        return self


class AlgoConfig(StrictModel):
    """Which advantage estimator and which loss. Defaults are GRPO with token-mean aggregation."""

    advantage: AdvantageName = "grpo"
    std_normalize: bool = True  # grpo: divide by the group's std (drgrpo never does)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    whiten_advantages: bool = True  # gae: normalise advantages over the batch's sampled tokens
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo", description="ppo: per-token importance ratios; gspo: each sequence's (the geometric mean of its "
        "tokens' ratios), clipped per sequence (pair it with loss_agg=seq_mean_token_mean and small clips)"
    )
    loss_agg: LossAgg = "token_mean"
    loss_norm_tokens: int | None = Field(
        None, ge=1, description="seq_mean_token_sum_norm's constant, the same every step (Dr.GRPO: the response "
        "budget); unset: a run config sets it to task.budgets.max_response_tokens"
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.2, ge=0.0, description="DAPO clip-higher: e.g. 0.28")
    dual_clip: float | None = Field(None, gt=1.0, description="dual-clip bound c for negative advantages, e.g. 3")
    kl: KLConfig = Field(default_factory=KLConfig)
    entropy_coef: float = Field(0.0, ge=0.0)
    value_clip: float | None = Field(0.2, gt=0.0, description="PPO value clipping range; unset: no clipping")
    tis_cap: float | None = Field(
        2.0, gt=0.0, description="decoupled: each token's loss weighted by w = pi_learner_old / pi_engine, bounded "
        "at tis_cap by tis_rule (against the policy that sampled: engine numerics, stale weights); null: no weights")
    tis_rule: TISRule = Field(
        "truncate", description="how tis_cap bounds the weights: truncate, min(w, tis_cap) for every token "
        "(truncated importance sampling); mask, w up to tis_cap and 0 above, the token leaving the loss "
        "(AReaL's decoupled objective)")
    off_policy: Literal["decoupled", "behaviour"] = Field(
        "decoupled", description="the PPO ratio's denominator: decoupled, the learner's logprobs before the step "
        "(the proximal policy), with the tis_cap weights to the engine's (the decoupled objective); behaviour, "
        "the engine's logprobs (plain PPO against the policy that sampled, however stale)")
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    drop_void_turns: bool = Field(
        False, description="SimpleTIR: trajectories with a turn that neither called a tool nor answered "
        "take no part in the loss"
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)

    @model_validator(mode="after")
    def _kl_reward_needs_returns(self) -> AlgoConfig:
        if self.kl.use == "reward" and self.kl.coef > 0 and self.advantage not in ("gae", "reinforce_pp",
                                                                                      "reinforce_pp_baseline"):
            raise ValueError(
                f"kl.use=reward needs a per-token return (advantage gae, reinforce_pp or reinforce_pp_baseline); "
                f"advantage {self.advantage!r} takes kl.use=loss"
            )
        return self

    @property
    def group_relative(self) -> bool:
        """Whether the advantage compares each sample with the others of its prompt's group."""
        return self.advantage in ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def needs_reference(self) -> bool:
        return self.kl.coef > 0
