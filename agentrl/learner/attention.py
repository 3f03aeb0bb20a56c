"""Packed attention for HF models: causal attention that stays inside each sequence of a packed row.

Registered with transformers' attention interface under the name "agentrl_packed", so any HF causal LM
whose attention layers go through that interface (every modern one) runs packed micro-batches
(packing.py) unchanged: worker.py passes `cu_seq_lens_q/k` and `max_length_q/k` (the keyword names
transformers' own flash-attention path uses) through the model's forward to this function. transformers
builds no mask for an implementation it does not know, so no [T, T] mask is ever made.

Per device:
- CUDA: `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen kernels shipped inside torch):
  no padding, no mask, cost proportional to the sum of squared sequence lengths.
- CPU, float32 on CUDA (flash kernels are 16-bit only) and CUDA without varlen: one
  `scaled_dot_product_attention(is_causal=True)` per sequence, exact and mask-free too.
Without packing kwargs (plain unpadded rows) it is causal SDPA over each row.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKED_ATTENTION = "agentrl_packed"

_VarlenFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, float | None], Tensor]
_VARLEN: _VarlenFn | None = None  # set by enable_packed_attention


def enable_packed_attention(model: nn.Module) -> None:
    """Switch an HF model (and its sub-configs) to packed attention; full causal attention only."""
    from transformers import AttentionInterface

    config = model.config
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("packed attention supports full causal attention only; this model uses sliding windows")
    global _VARLEN
    _VARLEN = _resolve_varlen()  # resolved here, not per call: torch.compile traces packed_attention
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    model.set_attn_implementation(PACKED_ATTENTION)
    if config._attn_implementation != PACKED_ATTENTION:  # transformers only warns for models it cannot switch
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' attention "
                         "interface, so packed sequences would attend across each other")


def packed_backend(device: torch.device) -> str:
    """Which kernel packed attention uses on `device` (for logs and benchmark tables)."""
    if device.type == "cuda" and _resolve_varlen() is not None:
        return "varlen flash attention (16-bit dtypes)"
    return "per-sequence SDPA"


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q [B, Hq, T, D], k/v [B, Hkv, T, D] -> out [B, T, Hq, D]."""
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention mask: pack sequences instead of padding them")
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch dimension 1)")
    varlen = _varlen_for(query)
    if varlen is not None:
        q_THD, k_THD, v_THD = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        out = varlen(q_THD, k_THD, v_THD, cu_seqlens, kwargs["max_length_q"], scaling)
        return out.unsqueeze(0), None
    return _per_sequence(query, key, value, cu_seqlens, scaling), None


def _varlen_for(query: Tensor) -> _VarlenFn | None:
    """The varlen kernel where it applies: CUDA tensors in 16-bit (flash attention has no float32)."""
    if _VARLEN is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        return _VARLEN
    return None


def _per_sequence(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scaling: float | None) -> Tensor:
    bounds = cu_seqlens.tolist()
    gqa = query.shape[1] != key.shape[1]
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa
        )
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _resolve_varlen() -> _VarlenFn | None:
    """torch's varlen flash attention, adapted to the signatures torch releases gave it; None if absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    native_gqa = "enable_gqa" in params
    has_scale = "scale" in params

    def run(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
        extra = dict(causal)
        if q_THD.shape[1] != k_THD.shape[1]:
            if native_gqa:
                extra["enable_gqa"] = True
            else:  # older releases: repeat kv heads as transformers' repeat_kv does (head i uses kv i // n_rep)
                rep = q_THD.shape[1] // k_THD.shape[1]
                k_THD, v_THD = k_THD.repeat_interleave(rep, dim=1), v_THD.repeat_interleave(rep, dim=1)
        if has_scale:
            extra["scale"] = scale
        return varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_len, max_len, **extra)

    return run
