"""The policy (actor) worker: logprobs of packed batches and the PPO-style policy update.

`PolicyModule` is the FSDP root around an HF causal LM: the base model runs a packed micro-batch
(attention.py), then logprob.py turns final hidden states into per-token logprobs and entropies chunk by
chunk, through the transform the model's own forward applies to its logits after the output head
(head.py). `PolicyWorker.train_step` combines them with the algorithm's pure losses (agentrl/algo/loss.py):
PPO clip (asymmetric, dual), importance weights against the engine's logprobs (truncated or masked), KL
to the reference as a loss term, an entropy bonus, aggregated with whole-batch weights. The trainer calls
`compute_logprobs`, `train_step`, `state_for_sync` (the weights to send to the engines), `save`/`load` and
`export_hf`. With `lora` set (lora.py) the model carries an adapter and only the adapter trains;
`compute_base_logprobs` is then the reference policy.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import behaviour_weights, gspo_logprobs, kl_penalty, masked_sum, ppo_clip_loss
from agentrl.learner import checkpoint, lora
from agentrl.learner.config import LearnerConfig
from agentrl.learner.head import head_transform
from agentrl.learner.logprobs import token_logprobs
from agentrl.learner.packing import Batch, MicroBatch
from agentrl.learner.worker import Worker, load_causal_lm, loss_weights, model_inputs


class PolicyModule(nn.Module):
    """HF causal LM -> (logprob of each target token, entropy of each position), float32 [T] each, under
    the model's own post-head transform (`head_transform`, checked here, at construction) and the
    sampling temperature."""

    def __init__(self, lm: nn.Module, config: LearnerConfig) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = config.logprob_chunk_tokens
        self.keep_logits = config.logprob_keep_logits
        self.temperature = config.temperature
        self.compiled = config.compile
        self.logit_transform = head_transform(lm)

    def forward(self, mb: MicroBatch) -> tuple[Tensor, Tensor]:
        hidden = self.lm.base_model(**model_inputs(mb)).last_hidden_state[0]
        head = self.lm.get_output_embeddings()
        training = torch.is_grad_enabled()  # without grad only logprobs are read (compute_logprobs)
        return token_logprobs(hidden, head.weight, mb.target_ids_T, self.chunk_tokens, self.temperature,
                              head.bias, self.compiled, self.keep_logits and training, with_entropy=training,
                              transform=self.logit_transform)


class PolicyWorker(Worker):
    role = "actor"

    def __init__(self, config: LearnerConfig, algo: AlgoConfig, model: nn.Module | None = None) -> None:
        ctx = Worker.context(config)
        lm = load_causal_lm(config, model)
        if config.lora is not None:
            lm = lora.add_lora(lm, config.lora)
        self.lm = lm
        self.algo = algo
        module = PolicyModule(lm, config)
        super().__init__(config, module, lm, "lm.", trainable=True, ctx=ctx)

    def compute_logprobs(self, batch: Batch) -> Tensor:
        """Logprob of every response token under the current weights: [B, R] float32 on CPU."""
        return self._infer(batch, lambda mb: self.module(mb)[0])

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step on `batch` (advantages set; old/ref logprobs set where the algorithm needs
        them: without old logprobs the update is on-policy, ratio 1). Returns `actor/*` metrics."""
        if any(mb.advantages_T is None for mb in batch.micro_batches):
            raise ValueError("train_step: batch has no advantages (Batch.set('advantages', ...))")
        use_kl = self.algo.kl.coef > 0 and self.algo.kl.use == "loss"
        if use_kl and any(mb.ref_logprobs_T is None for mb in batch.micro_batches):
            raise ValueError("train_step: kl.use=loss needs ref logprobs (Batch.set('ref_logprobs', ...))")
        return self._train(batch, lambda mb: self._micro_loss(mb, batch, use_kl))

    def _micro_loss(self, mb: MicroBatch, batch: Batch, use_kl: bool) -> tuple[Tensor, dict[str, Tensor]]:
        algo = self.algo
        logprobs_T, entropy_T = self.module(mb)
        assert mb.advantages_T is not None
        old_T = mb.old_logprobs_T if mb.old_logprobs_T is not None else logprobs_T.detach()
        ratio_logprobs_T = (gspo_logprobs(logprobs_T, old_T, mb.loss_mask_T, mb.seq_index_T, len(mb.rows))
                            if algo.policy_loss == "gspo" else logprobs_T)
        pg_T, clipped_T = ppo_clip_loss(ratio_logprobs_T, old_T, mb.advantages_T, algo.clip_low, algo.clip_high,
                                        algo.dual_clip)
        stats: dict[str, Tensor] = {}
        weights_T, token_mean_T = loss_weights(mb, batch, algo)
        if algo.tis_cap is not None and algo.off_policy == "decoupled":  # behaviour: the ratio is to the engine's
            tis_T = behaviour_weights(old_T, mb.engine_logprobs_T, algo.tis_cap, algo.tis_rule)
            pg_T = pg_T * tis_T
            stats["tis_weight"] = masked_sum(tis_T, token_mean_T)
            # the share of tokens the cap acted on (truncated, or masked out of the loss)
            capped_T = (old_T - mb.engine_logprobs_T > math.log(algo.tis_cap)).float()
            stats["tis_capped_frac"] = masked_sum(capped_T, token_mean_T)
        pg_loss = masked_sum(pg_T, weights_T)
        loss = pg_loss
        if use_kl:
            assert mb.ref_logprobs_T is not None
            kl_loss = masked_sum(kl_penalty(logprobs_T, mb.ref_logprobs_T, algo.kl.estimator), weights_T)
            loss = loss + algo.kl.coef * kl_loss
            stats["kl_loss"] = kl_loss
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * masked_sum(entropy_T, weights_T)
        log_ratio_T = (logprobs_T - old_T).detach()
        # The learner's logprobs before the step against the engine's for the same tokens: numerics for a
        # fresh sample, numerics and staleness for an older one. (Under the behaviour objective old_T is
        # the engine's, so the training forward's own stand in.)
        learner_T = old_T if algo.off_policy == "decoupled" else logprobs_T.detach()
        stats |= {
            "loss": loss,
            "pg_loss": pg_loss,
            "entropy": masked_sum(entropy_T.detach(), token_mean_T),
            "nll": masked_sum(-logprobs_T.detach(), token_mean_T),  # of the trained tokens, before the step
            "clip_frac": masked_sum(clipped_T, token_mean_T),
            "approx_kl": masked_sum(0.5 * log_ratio_T.square(), token_mean_T),
            "engine_kl": masked_sum(kl_penalty(old_T, mb.engine_logprobs_T, "k3"), token_mean_T),
            "logprob_gap": masked_sum((learner_T - mb.engine_logprobs_T).abs(), token_mean_T),
        }
        return loss, stats

    def export_hf(self, path: str, dtype: torch.dtype = torch.bfloat16, tokenizer: object = None) -> None:
        """`save_pretrained` directory (config + safetensors, and `tokenizer`'s files when given) that
        transformers and vLLM load; with LoRA the adapter merged in, and on its own under `adapter/`.
        Collective."""
        base = self.config.model  # a local base is recorded by its absolute path: the adapter names it
        base = str(Path(base).resolve()) if base and Path(base).is_dir() else base or None
        checkpoint.export_hf(path, self.module, self.lm, self.hf_prefix, dtype, self.ctx, tokenizer,
                             adapter=self.config.lora, base=base)

    def compute_base_logprobs(self, batch: Batch) -> Tensor:
        """Logprob of every response token under the base model, the LoRA adapter off: [B, R] float32 on
        CPU (the reference policy of an adapted model, reference.py)."""
        with lora.adapter_off(self.module):
            return self.compute_logprobs(batch)
