"""The frozen reference policy: logprobs for the KL term (agentrl/algo/loss.py `kl_penalty`).

Same packed forward as the policy (policy.py `PolicyModule`), but sharded in the compute dtype with no
float32 master copy, no gradients and no optimizer.
"""

from __future__ import annotations

from torch import Tensor, nn

from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import Batch
from agentrl.learner.policy import PolicyModule
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
