"""The learner's side of a step, in one process: the policy, and the reference and the critic where the
algorithm needs them (learner/), with what a step asks of them.

    Learner.learn(groups)   batch.py builds the step's batch (packing, logprobs, values, advantages),
                            then PPO epochs over its mini-batches: the policy's and the critic's updates
    Learner.push(engines)   weight_sync.py: the policy's new weights into the rollout engines
    save / load / export    the checkpoint's learner part, and the final HF checkpoint

Every method is collective over the learner's ranks: on Ray (placement.py) each rank holds one of these
and the driver calls them all alike.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch

from agentrl.batch import build_batch
from agentrl.learner.critic import CriticWorker
from agentrl.learner.packing import pack
from agentrl.learner.policy import PolicyWorker
from agentrl.learner.reference import BaseReference, ReferenceWorker
from agentrl.types import Group, Trajectory
from agentrl.weight_sync import push_weights, transport

if TYPE_CHECKING:
    from agentrl.run_config import RunConfig


class Learner:
    def __init__(self, config: RunConfig, lm: torch.nn.Module) -> None:
        self.config = config
        algo = config.algo
        lora = config.learner.lora is not None  # the reference is then the policy's base (BaseReference)
        self.reference = (ReferenceWorker(config.learner, model=copy.deepcopy(lm))
                          if algo.needs_reference and not lora else None)
        self.critic = (CriticWorker(config.critic, algo, model=copy.deepcopy(lm))
                       if algo.needs_critic and config.critic else None)
        self.policy = PolicyWorker(config.learner, algo, model=lm)
        if algo.needs_reference and lora:
            self.reference = BaseReference(self.policy)
        self.transport = transport(config)
        # A sleeping engine on this GPU wakes after the update and needs its memory back: what the step's
        # activations left in torch's cache is returned to the device once the step is done.
        self.frees_cache = config.engine_sleeps and torch.cuda.is_available()

    def learn(self, groups: list[Group]) -> dict[str, float]:
        """Batch, then PPO epochs over the mini-batches: metrics averaged over the optimizer steps."""
        t, cfg = self.config.trainer, self.config
        start = time.perf_counter()
        step_batch = build_batch(groups, algo=cfg.algo, token_budget=cfg.learner.token_budget,
                                 mini_batches=t.mini_batches, policy=self.policy, reference=self.reference,
                                 critic=self.critic, drop_void_turns=cfg.algo.drop_void_turns,
                                 ppo_epochs=t.ppo_epochs)
        metrics = dict(step_batch.metrics)
        metrics["timing/logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(t.ppo_epochs):
            for batch in step_batch.mini_batches:
                out = self.policy.train_step(batch)
                if self.critic is not None:
                    out |= self.critic.train_step(batch)
                for k, v in out.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        for worker in (self.policy, self.critic):  # the schedules count trainer steps
            if worker is not None:
                worker.end_step()
                if worker.skipped_in_a_row >= t.max_skipped_in_a_row:
                    raise RuntimeError(f"the {worker.role}'s last {worker.skipped_in_a_row} optimizer steps had a loss "
                                       "or gradient that is not finite (each was skipped; "
                                       f"trainer.max_skipped_in_a_row is {t.max_skipped_in_a_row}): the run stops "
                                       "with its weights as they were before them")
        metrics |= {k: v / steps for k, v in sums.items()}
        if self.frees_cache:
            torch.cuda.empty_cache()
        metrics["timing/train"] = time.perf_counter() - start
        return metrics

    def score(self, trajectory: Trajectory) -> list[float]:
        """The policy's logprob of each response token of `trajectory` (one copy per rank: every rank
        takes part in the forward)."""
        ctx = self.policy.ctx
        batch = pack([trajectory] * ctx.world_size, self.config.learner.token_budget, ctx.world_size)[ctx.rank]
        return self.policy.compute_logprobs(batch)[0, : len(trajectory.response_ids)].tolist()

    async def push(self, engine: Any) -> dict[str, float]:
        return await push_weights(self.policy, engine, self.transport)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.policy.save(f"{path}/actor", extra=extra)
        if self.critic is not None:
            self.critic.save(f"{path}/critic")

    def load(self, path: str) -> None:
        self.policy.load(f"{path}/actor")
        if self.critic is not None:
            self.critic.load(f"{path}/critic")

    def export(self, path: str, tokenizer: Any) -> None:
        self.policy.export_hf(path, tokenizer=tokenizer)
