"""The critic worker for PPO: a scalar value head on an HF causal LM's base model.

`ValueModule` runs the base model (no output embedding: it is dropped, saving the vocabulary matrix) on a
packed micro-batch and maps each position's final hidden state to V(s): the value of the state *before*
the token that position predicts, aligned like the policy's logprobs (packing.py). `compute_values` feeds
GAE (agentrl/algo/advantage.py); `train_step` regresses on the returns with the clipped value loss.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import masked_sum, value_loss
from agentrl.learner import lora
from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import Batch, MicroBatch
from agentrl.learner.worker import Worker, load_causal_lm, loss_weights, model_inputs


class ValueModule(nn.Module):
    """Base model + Linear(hidden, 1) -> values float32 [T]. The head starts at zero (V = 0 everywhere),
    so the first updates fit the head before they move the shared body."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb: MicroBatch) -> Tensor:
        hidden_TH = self.backbone(**model_inputs(mb)).last_hidden_state[0]
        # addmv makes a fresh [T] tensor (FSDP warns about view outputs of a wrapped module)
        return torch.addmv(self.value_head.bias, hidden_TH, self.value_head.weight[0]).float()


class CriticWorker(Worker):
    role = "critic"

    def __init__(self, config: LearnerConfig, algo: AlgoConfig, model: nn.Module | None = None) -> None:
        ctx = Worker.context(config)
        lm = load_causal_lm(config, model)
        if config.lora is not None:  # an adapter of its own on the backbone; the value head trains whole
            lm = lora.add_lora(lm, config.lora, "critic.lora")
        backbone = lm.base_model
        self.algo = algo
        module = ValueModule(backbone, lm.config.hidden_size)  # a new head: trainable
        super().__init__(config, module, backbone, "backbone.", trainable=True, ctx=ctx)

    def compute_values(self, batch: Batch) -> Tensor:
        """V of the state before every response token: [B, R] float32 on CPU."""
        return self._infer(batch, self.module)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on `batch` (returns and old values set)."""
        if any(mb.returns_T is None or mb.old_values_T is None for mb in batch.micro_batches):
            raise ValueError("critic train_step: set 'returns' and 'old_values' on the batch first")
        return self._train(batch, lambda mb: self._micro_loss(mb, batch))

    def _micro_loss(self, mb: MicroBatch, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        assert mb.returns_T is not None and mb.old_values_T is not None
        values_T = self.module(mb)
        loss_T, clipped_T = value_loss(values_T, mb.old_values_T, mb.returns_T, self.algo.value_clip)
        weights_T, token_mean_T = loss_weights(mb, batch, self.algo)
        loss = masked_sum(loss_T, weights_T)
        return loss, {
            "value_loss": loss,
            "value_clip_frac": masked_sum(clipped_T, token_mean_T),
            "values": masked_sum(values_T.detach(), token_mean_T),
        }
