"""The policy (actor) worker: logprobs of packed batches and the PPO-style policy update.

`PolicyModule` is the FSDP root around an HF causal LM: the base model runs a packed micro-batch
(attention.py), then logprob.py turns final hidden states into per-token logprobs and entropies chunk by
chunk, through the transform the model's own forward applies to its logits after the output head
(`head_transform`: Granite's scaling, Cohere's, a final softcap; others are refused).
`PolicyWorker.train_step` combines them with the algorithm's pure losses (agentrl/algo/loss.py):
PPO clip (asymmetric, dual), importance weights against the engine's logprobs (truncated or masked), KL
to the reference as a loss term, an entropy bonus, aggregated with whole-batch weights. The trainer calls `compute_logprobs`,
`train_step`, `state_for_sync` (the weights to send to the engines), `save`/`load` and `export_hf`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import behaviour_weights, gspo_logprobs, kl_penalty, masked_sum, ppo_clip_loss
from agentrl.learner import checkpoint
from agentrl.learner.config import LearnerConfig
from agentrl.learner.logprobs import LogitTransform, token_logprobs
from agentrl.learner.packing import Batch, MicroBatch
from agentrl.learner.worker import Worker, load_causal_lm, loss_weights, model_inputs

# What each model type's causal-LM forward does to its output projection, in order: (attribute of the text
# config, step). "multiply"/"divide": the logits by the value; "softcap": value * tanh(logits / value), no
# step when the value is None; "divide_hidden": the final hidden states, before a bias-free head, so the
# same as dividing its logits; "read": an attribute the other steps already account for. Keyed by the
# top-level model_type, as a composite model's forward may differ from its text model's (Gemma-3's
# applies no softcap).
_GRANITE = (("logits_scaling", "divide"),)
_COHERE = (("logit_scale", "multiply"),)
_SOFTCAP = (("final_logit_softcapping", "softcap"),)
HEAD_TRANSFORMS: dict[str, tuple[tuple[str, str], ...]] = {
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                     "granitemoe_swa"), _GRANITE),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), _COHERE),
    "hyperclovax": (("logits_scaling", "multiply"),),  # Granite's attribute name, the opposite step
    "falcon_h1": (("lm_head_multiplier", "multiply"),),
    "minicpm3": (("logits_scaling", "divide_hidden"), ("dim_model_base", "read")),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text",
                     "gemma4_unified", "vaultgemma", "nanochat", "beam"), _SOFTCAP),
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"),  # their head already has the unpadded rows only
                    (("final_logit_softcapping", "softcap"), ("unpadded_vocab_size", "read"))),
    "inkling_text": (("logits_mup_width_multiplier", "divide_hidden"),),  # its vocabulary cut is refused
    "recurrent_gemma": (("logits_soft_cap", "softcap"),),
    "xlstm": (("output_logit_soft_cap", "softcap"),),
}
_VERBS = {"multiply": "multiplies its logits by it", "divide": "divides its logits by it",
          "divide_hidden": "divides its final hidden states by it", "softcap": "softcaps its logits at it"}

# Config attributes through which some model's forward changes its logits after (or just before) the output
# head, each with the test of a value that leaves them unchanged. Set otherwise on a model type whose steps
# do not read it, the attribute is refused: an engine may apply it, the learner would not.
_NEUTRAL: dict[str, Callable[[Any, Any], bool]] = {
    **dict.fromkeys(("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier",
                     "logits_mup_width_multiplier"), lambda v, c: v is None or v == 1),
    **dict.fromkeys(("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"),
                    lambda v, c: v is None),
    "dim_model_base": lambda v, c: v is None or v == getattr(c, "hidden_size", None),
    "unpadded_vocab_size": lambda v, c: v is None or v >= getattr(c, "vocab_size", v),
}
# Any other attribute with a name like this is taken for a post-head transform unless it is None or False,
# so that an unknown one is refused rather than skipped. These names match but act elsewhere (attention,
# routers, contrastive towers) or are switches that leave the logits alone.
_HEAD_LIKE = re.compile(r"logit|lm_head|output_mult")
_NOT_POST_HEAD = frozenset({
    "attn_logit_softcapping", "attention_logit_cap", "conf_attention_logit_cap", "moe_router_logit_softcapping",
    "output_router_logits", "num_logits_to_keep", "output_logits", "output_auxiliary_logits",
    "logit_scale_init_value", "max_logit_scale", "contrastive_logits_temperature", "lsd_time_logit_mean",
    "lsd_time_logit_std", "average_logits_per_cell", "attention_invalid_logits_value", "lm_head_bias",
    "freeze_lm_head", "chunk_size_lm_head",
})


def head_transform(lm: nn.Module) -> LogitTransform:
    """The transform `lm`'s own forward applies to its output projection before its logits are sampled
    from, read from its config (HEAD_TRANSFORMS). Raises ValueError where the learner's forward (base model,
    output embedding's weight and bias, this transform) would not reproduce the model's: a post-head
    attribute its model type's steps do not read, an invalid value of one they do, an output embedding
    with a forward of its own, weights or buffers outside the base model and the output embedding."""
    name = type(lm).__name__
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise ValueError(f"{name}: the output embedding is {type(head).__name__}, expected a plain nn.Linear: the "
                         "learner multiplies by its weight directly, so anything else its forward does is skipped")
    inside = {id(t) for m in (lm.base_model, head) for t in (*m.parameters(), *m.buffers())}
    stray = [n for n, t in (*lm.named_parameters(), *lm.named_buffers()) if id(t) not in inside]
    if stray:
        raise ValueError(f"{name}: {', '.join(stray[:4])}{' ...' if len(stray) > 4 else ''} lie outside the base "
                         "model and the output embedding, expected nothing there: the learner's forward (base model, "
                         "then the output embedding) would skip them")
    config = lm.config
    try:
        text = config.get_text_config()
    except ValueError:  # several text sub-configs (encoder and decoder): the causal LM reads its own
        text = config
    model_type = config.model_type
    steps = HEAD_TRANSFORMS.get(model_type, ())
    _refuse_unapplied(name, config, text, steps)
    scale, softcap = 1.0, None
    for attr, step in steps:
        value = _read(text, attr)
        if step == "read" or (step == "softcap" and value is None):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: {_where(config, text)}.{attr} = {value!r}, expected a positive finite "
                             f"number ({model_type} {_VERBS[step]})")
        if softcap is not None:  # no known model scales after its softcap: LogitTransform has no such form
            raise ValueError(f"{name}: {attr} ({step}) comes after a softcap, expected scales before it")
        if step == "divide_hidden" and head.bias is not None:
            raise ValueError(f"{name}: {attr} divides the hidden states before an output head with a bias, "
                             "expected a bias-free head (the learner divides the logits instead)")
        if step == "softcap":
            softcap = float(value)
        else:
            scale = scale * value if step == "multiply" else scale / value
    return LogitTransform(float(scale), softcap)


def _where(config: Any, owner: Any) -> str:
    """How `owner` (the config or one of its sub-configs) is reached from the model's config, for errors."""
    if owner is config:
        return "config"
    return "config." + next((k for k, v in vars(config).items() if v is owner), "text_config")


def _read(config: Any, attr: str) -> Any:
    """config.attr, None if absent. Some configs guard attributes behind errors of their own (per-layer
    values read globally); the stored value stands in then."""
    try:
        return getattr(config, attr, None)
    except Exception:
        return vars(config).get(attr)


def _refuse_unapplied(name: str, config: Any, text: Any, steps: tuple[tuple[str, str], ...]) -> None:
    read = {attr for attr, _ in steps}
    applied = ", ".join(f"{step} by {attr}" for attr, step in steps if step != "read") or "none"
    for owner in (config,) if text is config else (config, text):
        for attr in sorted(set(vars(owner)) | set(_NEUTRAL)):
            known = attr in _NEUTRAL
            if attr in read or not (known or (_HEAD_LIKE.search(attr) and attr not in _NOT_POST_HEAD)):
                continue
            value = _read(owner, attr)
            if (_NEUTRAL[attr](value, owner) if known else value is None or value is False):
                continue
            expected = "a value that leaves the logits unchanged" if known else "no such attribute"
            raise ValueError(
                f"{name}: {_where(config, owner)}.{attr} = {value!r} is read as a transform of the logits after the "
                f"output head, which the learner does not apply for model_type {config.model_type!r} (it applies: "
                f"{applied}), so it would train another distribution than the engines sample. Expected {expected}, "
                "or a model type whose transform the learner applies (policy.HEAD_TRANSFORMS)")


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
        transformers and vLLM load. Collective."""
        checkpoint.export_hf(path, self.module, self.lm, self.hf_prefix, dtype, self.ctx, tokenizer)
