"""The frozen reference policy: logprobs for the KL term (agentrl/algo/loss.py `kl_penalty`).

Same packed forward as the policy (policy.py `PolicyModule`), but sharded in the compute dtype with no
float32 master copy, no gradients and no optimizer. A LoRA policy's reference is its own base, the adapter
switched off (`BaseReference`): no second copy of the weights.
"""

from __future__ import annotations

from torch import Tensor, nn

from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import Batch
from agentrl.learner.policy import PolicyModule, PolicyWorker
from agentrl.learner.worker import Worker, load_causal_lm


class ReferenceWorker(Worker):
    role = "ref"

    def __init__(self, config: LearnerConfig, model: nn.Module | None = None) -> None:
        ctx = Worker.context(config)
        lm = load_causal_lm(config, model)
        module = PolicyModule(lm, config)
        super().__init__(config, module, lm, "lm.", trainable=False, ctx=ctx)

    def compute_logprobs(self, batch: Batch) -> Tensor:
        """Reference logprob of every response token: [B, R] float32 on CPU."""
        return self._infer(batch, lambda mb: self.module(mb)[0])


class BaseReference:
    """The reference of a LoRA policy: the policy's own base model, its adapter off while it scores."""

    role = "ref"

    def __init__(self, policy: PolicyWorker) -> None:
        self.policy = policy

    def compute_logprobs(self, batch: Batch) -> Tensor:
        return self.policy.compute_base_logprobs(batch)
