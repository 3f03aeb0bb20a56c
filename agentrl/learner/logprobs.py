"""Per-token logprobs and entropies from final hidden states, chunked over tokens.

A 152k-token vocabulary makes the logits of a 4k-token micro-batch 2.5 GB in fp32, and autograd would keep
several such tensors alive until backward. `token_logprobs` instead projects `chunk_tokens` positions at a
time, keeps only per-token numbers (logprob, log-sum-exp, entropy) and recomputes each chunk's logits in
backward (one extra vocabulary matmul: 2 x vocabulary x hidden FLOPs per token, about 5% of a 1.5B model's
6 x parameters), so memory for the head stays one
chunk's worth however large the micro-batch is. Gradients flow to the hidden states, the output embedding
(tied or not) and its bias, for the logprob and the entropy both.

Called by worker.py inside the FSDP root's forward (the gathered output-embedding weight is used
directly). With `compiled=True` the per-chunk elementwise math goes through torch.compile, which fuses it
into a few passes over the bf16 logits.

Some models change the logits after the output projection before anything samples from them (a scale, a
tanh softcap: `LogitTransform`, read from the HF config by policy.py). The transform is applied here, per
chunk, before the temperature, so logprobs, entropies and gradients are those of the distribution the
engines sample. A scale alone folds into the temperature's multiplier: no extra pass over the logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitTransform:
    """What a model's own forward does to the output projection's logits x before they are sampled from:
    x * scale, then, with `softcap`, softcap * tanh(x * scale / softcap). The default is the identity."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"LogitTransform.scale must be a positive finite number, got {self.scale!r}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"LogitTransform.softcap must be a positive finite number or None, got {self.softcap!r}")


def token_logprobs(
    hidden_TH: Tensor,
    weight_VH: Tensor,
    target_ids_T: Tensor,
    chunk_tokens: int = 2048,
    temperature: float = 1.0,
    bias_V: Tensor | None = None,
    compiled: bool = False,
    keep_logits: bool = False,
    with_entropy: bool = True,
    transform: LogitTransform | None = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(t(hidden @ weight.T) / temperature)[target] and the entropy of that softmax, per token,
    both float32 [T], with t the model's `transform` of its logits (None: the identity). Differentiable in
    hidden, weight and bias. `keep_logits` saves each chunk's logits (in the weight's dtype) for backward
    instead of recomputing them: a vocabulary matmul less, memory that grows with T again.
    `with_entropy=False` (logprobs alone, e.g. old and reference logprobs) skips the entropy's passes over
    each chunk and returns zeros for it, not differentiable."""
    stats, grad = (_compiled_fns() if compiled else (_chunk_stats, _chunk_grad))
    # Per chunk the scaled logits are z = mult * x, or z = mult * tanh(x * tanh_scale) under a softcap.
    transform = transform or LogitTransform()
    tanh_scale: float | None = None
    if transform.softcap is None:
        mult = transform.scale / temperature
    else:
        mult, tanh_scale = transform.softcap / temperature, transform.scale / transform.softcap
    return _ChunkedLogprobs.apply(hidden_TH, weight_VH, bias_V, target_ids_T, chunk_tokens, mult, tanh_scale,
                                  stats, grad, keep_logits, with_entropy)


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return hidden @ weight.t() if bias is None else torch.addmm(bias, hidden, weight.t())


def _chunk_stats(
    logits_CV: Tensor, targets_C: Tensor, inv_temp: float, with_entropy: bool = True,
    tanh_scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logprob of target, log-sum-exp, entropy or None) of one chunk, in float32, of the scaled logits
    z = inv_temp * x, or z = inv_temp * tanh(tanh_scale * x) for a softcapped model (see token_logprobs).
    Two passes over the logits however it runs: the row max, then sum(e) and sum(e * (z - max)) together
    (e = exp(z - max)); entropy is lse - sum(p * z) = log(sum(e)) - sum(e * (z - max)) / sum(e), free of
    the logits' offset."""
    if tanh_scale is None:
        z = logits_CV.float() * inv_temp
    else:
        z = torch.tanh(logits_CV.float() * tanh_scale) * inv_temp
    top = z.amax(dim=-1, keepdim=True)
    shifted = z - top
    e = torch.exp(shifted)
    total = e.sum(-1)
    log_total = torch.log(total)
    lse = top.squeeze(-1) + log_total
    logprob = z.gather(1, targets_C[:, None]).squeeze(1) - lse
    if not with_entropy:
        return logprob, lse, None
    return logprob, lse, log_total - (e * shifted).sum(-1) / total


def _chunk_grad(
    logits_CV: Tensor, targets_C: Tensor, lse_C: Tensor, entropy_C: Tensor, g_lp_C: Tensor,
    g_ent_C: Tensor | None, inv_temp: float, tanh_scale: float | None = None,
) -> Tensor:
    """d(loss)/d(logits) of one chunk, in the logits' dtype. With z the scaled logits and p = softmax(z):
    d logprob/dz = onehot(target) - p and d entropy/dz = -p * (z - sum(p * z)), sum(p * z) = lse - entropy;
    dz/dx = inv_temp, or inv_temp * tanh_scale * (1 - tanh(tanh_scale * x)^2) under a softcap."""
    slope = None
    if tanh_scale is None:
        z = logits_CV.to(torch.float32, copy=True).mul_(inv_temp)  # a copy: kept logits must stay intact
    else:  # the tanh is kept for dz/dx: one float32 chunk more than the uncapped path
        t = logits_CV.to(torch.float32, copy=True).mul_(tanh_scale).tanh_()
        z = t * inv_temp
        slope = t.square_().neg_().add_(1.0).mul_(inv_temp * tanh_scale)
    p = (z - lse_C[:, None]).exp_()
    if g_ent_C is None:
        g = p.mul_(-g_lp_C[:, None])
    else:  # -p * (g_lp + g_ent * (z - sum(p z))), built in place in z's buffer
        coef = z.sub_((lse_C - entropy_C)[:, None]).mul_(g_ent_C[:, None]).add_(g_lp_C[:, None])
        g = p.mul_(coef).neg_()
    g.scatter_add_(1, targets_C[:, None], g_lp_C[:, None])
    return (g.mul_(inv_temp) if slope is None else g.mul_(slope)).to(logits_CV.dtype)


def _chunk_grad_fused(
    logits_CV: Tensor, targets_C: Tensor, lse_C: Tensor, entropy_C: Tensor, g_lp_C: Tensor,
    g_ent_C: Tensor | None, inv_temp: float, tanh_scale: float | None = None,
) -> Tensor:
    """_chunk_grad's math written for torch.compile: the target's one-hot term is a comparison, not a
    scatter, so inductor fuses the whole chunk into one pass that reads the 16-bit logits and writes the
    16-bit gradient (the scatter kept a float32 gradient in memory, then cast it in a pass of its own).
    Eager, it would hold several float32 chunks at once: _chunk_grad is the eager form."""
    if tanh_scale is None:
        z = logits_CV.float() * inv_temp
        slope: Tensor | float = inv_temp
    else:
        t = torch.tanh(logits_CV.float() * tanh_scale)
        z = t * inv_temp
        slope = (1.0 - t * t) * (inv_temp * tanh_scale)
    p = torch.exp(z - lse_C[:, None])
    coef = g_lp_C[:, None]
    if g_ent_C is not None:
        coef = coef + g_ent_C[:, None] * (z - (lse_C - entropy_C)[:, None])
    hit = torch.arange(z.shape[1], device=z.device)[None, :] == targets_C[:, None]
    return ((torch.where(hit, g_lp_C[:, None], 0.0) - p * coef) * slope).to(logits_CV.dtype)


@lru_cache(maxsize=1)
def _compiled_fns() -> tuple[Callable[..., Any], Callable[..., Any]]:
    return torch.compile(_chunk_stats, dynamic=True), torch.compile(_chunk_grad_fused, dynamic=True)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk: int,
        inv_temp: float, tanh_scale: float | None, stats: Callable[..., Any], grad: Callable[..., Any],
        keep_logits: bool, with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logprob, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(2))
        entropy = (torch.empty if with_entropy else torch.zeros)(n, dtype=torch.float32, device=hidden.device)
        kept = []
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            logits = _logits(hidden[a:b], weight, bias)
            logprob[a:b], lse[a:b], entropy_C = stats(logits, targets[a:b], inv_temp, with_entropy, tanh_scale)
            if with_entropy:
                entropy[a:b] = entropy_C
            if keep_logits:
                kept.append(logits)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, *kept)
        ctx.chunk, ctx.inv_temp, ctx.tanh_scale, ctx.grad = chunk, inv_temp, tanh_scale, grad
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx: Any, g_logprob: Tensor | None, g_entropy: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy, *kept = ctx.saved_tensors
        if g_logprob is None:
            g_logprob = torch.zeros_like(lse)
        n, chunk = hidden.shape[0], ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        multi = n > chunk  # several chunks add into the weight gradient: accumulate those sums in float32
        grad_w: Tensor | None = None
        grad_b: Tensor | None = None
        for i, a in enumerate(range(0, n, chunk)):
            b = min(a + chunk, n)
            h = hidden[a:b]
            logits = kept[i] if kept else _logits(h, weight, bias)
            g = ctx.grad(logits, targets[a:b], lse[a:b], entropy[a:b], g_logprob[a:b],
                         None if g_entropy is None else g_entropy[a:b], ctx.inv_temp, ctx.tanh_scale)
            if grad_h is not None:
                torch.matmul(g, weight, out=grad_h[a:b])
            if need_w:
                part = g.t() @ h
                grad_w = (part.float() if multi else part) if grad_w is None else grad_w.add_(part)
            if need_b:
                part_b = g.float().sum(0)
                grad_b = part_b if grad_b is None else grad_b.add_(part_b)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and bias is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None
