"""The transform a causal LM's own forward applies to its logits after the output head, for the learner.

The learner builds logits from the base model's final hidden states and the head's weight (logprobs.py), so
whatever a model's `forward` does after the head (Granite's and Cohere's scaling, a final softcap) must be
applied there too, or the learner trains another distribution than the engines sample. `head_transform`
reads it from the model's config by model type; a model whose config carries a post-head setting the
learner does not apply, or whose head or extra weights its forward would use, is refused, naming it.
policy.py (and reference.py through it) call it when they build their module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from torch import nn

from agentrl.learner.logprobs import LogitTransform

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
