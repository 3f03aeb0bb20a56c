"""Packed attention for HF models: causal attention that stays inside each sequence of a packed row.

Registered with transformers' attention interface under the name "agentrl_packed", so any HF causal LM
whose attention layers go through that interface (every modern one) runs packed micro-batches
(packing.py) unchanged: worker.py passes `cu_seq_lens_q/k` and `max_length_q/k` (the keyword names
transformers' own flash-attention path uses) through the model's forward to this function. transformers
builds no mask for an implementation it does not know, so no [T, T] mask is ever made.

Per device:
- CUDA: the FlashAttention-2 varlen kernels inside torch (`aten._flash_attention_forward`): no padding, no
  mask, cost proportional to the sum of squared sequence lengths. With `learner.attention_kernel: fa4`, the
  flash-attn-4 package's varlen kernels instead (Hopper/Blackwell; opt-in: it needs that package, and its
  faster training step did not hold on every machine measured: BENCHMARKS.md).
- CPU, float32 on CUDA (flash kernels are 16-bit only) and CUDA builds without flash attention: one
  `scaled_dot_product_attention(is_causal=True)` per sequence, exact and mask-free too.
Without packing kwargs (plain unpadded rows) it is causal SDPA over each row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PACKED_ATTENTION = "agentrl_packed"

_VarlenFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, float | None], Tensor]
_VARLEN: _VarlenFn | None = None  # set by enable_packed_attention
# The varlen kernels on CUDA (learner.attention_kernel), as logs and benchmark tables name them.
KERNELS = {"flash2": "varlen FlashAttention-2 in torch", "fa4": "varlen flash-attn-4"}


def enable_packed_attention(model: nn.Module, kernel: str = "flash2") -> None:
    """Switch an HF model (and its sub-configs) to packed attention; full causal attention only. `kernel`
    names the varlen kernel used on CUDA in 16-bit (see _resolve_varlen); "fa4" must be installed."""
    from transformers import AttentionInterface

    config = model.config
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError("packed attention supports full causal attention only; this model uses sliding windows")
    for name in ("attn_logit_softcapping", "attention_logit_cap"):  # the varlen kernels take no softcap
        if getattr(config.get_text_config(), name, None) is not None:
            raise ValueError(f"packed attention has no attention-score softcap: this model's config sets {name}="
                             f"{getattr(config.get_text_config(), name)!r}; expected None")
    global _VARLEN
    varlen = _resolve_varlen(kernel)  # resolved here, not per call: torch.compile traces packed_attention
    if varlen is None and kernel != "flash2":
        raise ValueError(f"packed attention kernel {kernel!r} is not installed (fa4: pip install flash-attn-4)")
    _VARLEN = varlen
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    model.set_attn_implementation(PACKED_ATTENTION)
    if config._attn_implementation != PACKED_ATTENTION:  # transformers only warns for models it cannot switch
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' attention "
                         "interface, so packed sequences would attend across each other")


def packed_backend(device: torch.device, kernel: str = "flash2") -> str:
    """Which kernel packed attention uses on `device` (for logs and benchmark tables)."""
    if device.type == "cuda" and _resolve_varlen(kernel) is not None:
        return f"{KERNELS[kernel]} (16-bit dtypes)"
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


def _resolve_varlen(kernel: str = "flash2") -> _VarlenFn | None:
    """The varlen kernel named `kernel`, adapted to one signature; None if it is not installed.
    "flash2": the FlashAttention-2 kernels shipped inside torch (CUDA builds with flash attention; the
    kernels need an Ampere or newer GPU); without them packed attention falls back to per-sequence SDPA.
    "fa4": the CuTe-DSL FlashAttention kernels of the `flash-attn-4` package (Hopper and Blackwell),
    through the custom ops below so torch.compile treats them as opaque calls."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown packed-attention kernel {kernel!r}; expected one of {sorted(KERNELS)}")
    if kernel == "fa4":
        try:
            import flash_attn.cute.interface  # noqa: F401
        except ImportError:
            return None
        return _fa4
    return _flash2 if torch.backends.cuda.is_flash_attention_available() else None


def _flash2(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
    """Causal varlen attention by the FlashAttention-2 kernels inside torch, called as the aten op itself:
    grouped-query heads natively (k/v keep their own heads), differentiable through aten's own backward
    formula, and no Python around it, so inductor's C++ wrapper (fsdp.py) calls it straight from C++."""
    return torch.ops.aten._flash_attention_forward(q_THD, k_THD, v_THD, cu, cu, max_len, max_len, 0.0, True, False,
                                                   scale=scale)[0]


def _fa4(q_THD: Tensor, k_THD: Tensor, v_THD: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
    """Causal varlen attention by flash-attn-4 (grouped-query heads natively: k/v keep their own heads)."""
    scale = q_THD.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.agentrl.fa4_varlen(q_THD, k_THD, v_THD, cu, max_len, scale)[0]


@torch.library.custom_op("agentrl::fa4_varlen", mutates_args=())
def _fa4_forward(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                               max_seqlen_k=max_len, softmax_scale=scale, causal=True, return_lse=True)[:2]
    return out, lse


@_fa4_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("agentrl::fa4_varlen_backward", mutates_args=())
def _fa4_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor, max_len: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, grad_out, lse, softmax_scale=scale, causal=True, cu_seqlens_q=cu,
                                 cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len)[:3]
    return dq, dk, dv


@_fa4_backward_op.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor, max_len: int,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu)
    ctx.max_len, ctx.scale = max_len, scale


def _fa4_grad(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = torch.ops.agentrl.fa4_varlen_backward(grad_out.contiguous(), q, k, v, out, lse, cu, ctx.max_len,
                                                       ctx.scale)
    return dq, dk, dv, None, None, None


_fa4_forward.register_autograd(_fa4_grad, setup_context=_fa4_setup)
