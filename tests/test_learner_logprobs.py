"""Chunked logprobs and entropies (agentrl/learner/logprobs.py) against a full log-softmax."""

from __future__ import annotations

import pytest
import torch

from agentrl.learner.logprobs import (
    LogitTransform,
    _chunk_grad,
    _chunk_grad_fused,
    _chunk_stats,
    token_logprobs,
)


def _reference(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, temp: float,
               transform: LogitTransform | None = None):
    logits = (h @ w.t() if b is None else h @ w.t() + b).double()
    if transform is not None:  # as a model's forward does it, on the whole logits
        logits = logits * transform.scale
        if transform.softcap is not None:
            logits = torch.tanh(logits / transform.softcap) * transform.softcap
    logp = torch.log_softmax(logits / temp, -1)
    return logp.gather(1, y[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _inputs(seed: int, with_bias: bool):
    """Hidden states [37, 16], a head [50, 16] (and bias), targets, and upstream gradients of the outputs."""
    torch.manual_seed(seed)
    T, H, V = 37, 16, 50
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if with_bias else None
    return h, w, b, torch.randint(0, V, (T,)), torch.randn(T), torch.randn(T)


@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
@pytest.mark.parametrize("with_bias,temp,keep,compiled", [(False, 1.0, False, False), (True, 0.7, False, False),
                                                          (True, 0.7, True, False), (True, 0.7, False, True)])
def test_values_and_gradients_match_full_softmax(chunk: int, with_bias: bool, temp: float, keep: bool,
                                                 compiled: bool) -> None:
    h, w, b, y, g_lp, g_ent = _inputs(chunk, with_bias)
    inputs = [h, w] + ([b] if b is not None else [])
    lp, ent = token_logprobs(h, w, y, chunk, temp, b, compiled=compiled, keep_logits=keep)
    lp_ref, ent_ref = _reference(h, w, b, y, temp)
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-4)
    for use_entropy in (False, True):
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if use_entropy else 0.0)
        loss_ref = (lp_ref * g_lp).sum() + ((ent_ref * g_ent).sum() if use_entropy else 0.0)
        grads = torch.autograd.grad(loss, inputs, retain_graph=True)
        grads_ref = torch.autograd.grad(loss_ref, inputs, retain_graph=True)
        for g, g_ref in zip(grads, grads_ref, strict=True):
            assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-4)


TRANSFORMS = {"scale": LogitTransform(scale=0.125), "softcap": LogitTransform(softcap=2.0),
              "scale+softcap": LogitTransform(scale=0.5, softcap=3.0)}


@pytest.mark.parametrize("chunk", [7, 100])
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("with_bias,keep,compiled", [(False, False, False), (True, True, False), (True, False, True)])
def test_transformed_logits_match_full_softmax(chunk: int, transform: LogitTransform, with_bias: bool, keep: bool,
                                               compiled: bool) -> None:
    """A model's post-head transform (scale, softcap) inside the chunks: logprobs, entropies and gradients
    of softmax(transform(logits) / T), on logits spread wide enough for the softcap to bend them."""
    h, w, b, y, g_lp, g_ent = _inputs(chunk, with_bias)
    inputs = [h, w] + ([b] if b is not None else [])
    lp, ent = token_logprobs(h, w, y, chunk, 0.7, b, compiled=compiled, keep_logits=keep, transform=transform)
    lp_ref, ent_ref = _reference(h, w, b, y, 0.7, transform)
    lp_plain, _ = _reference(h, w, b, y, 0.7)
    assert float((lp_plain - lp_ref).abs().max()) > 1.0  # the transform matters here
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    assert torch.allclose(ent.double(), ent_ref, atol=1e-4)
    loss = (lp * g_lp).sum() + (ent * g_ent).sum()
    loss_ref = (lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()
    for g, g_ref in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(loss_ref, inputs), strict=True):
        assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_the_identity_transform_is_the_plain_path() -> None:
    torch.manual_seed(4)
    h, w, y = torch.randn(20, 8), torch.randn(30, 8), torch.randint(0, 30, (20,))
    plain = token_logprobs(h, w, y, 7, 0.7)
    for a, b in zip(plain, token_logprobs(h, w, y, 7, 0.7, transform=LogitTransform()), strict=True):
        assert torch.equal(a, b)


def test_no_logits_are_kept_for_backward() -> None:
    """Only per-token numbers are saved: nothing of T x V lives until backward, however large T is."""
    T, H, V = 64, 8, 300
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (T,))
    saved: list[int] = []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        lp, ent = token_logprobs(h, w, y, chunk_tokens=16)
    assert max(saved) <= max(T * H, V * H)  # hidden states and the weight, never logits
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        saved.clear()
        torch.log_softmax(h @ w.t(), -1)
    assert max(saved) >= T * V  # what the plain path keeps
    (lp.sum() + ent.sum()).backward()
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("compiled", [False, True])
def test_logprobs_alone_skip_the_entropy(compiled: bool) -> None:
    torch.manual_seed(3)
    T, H, V = 37, 16, 50
    h, w, y = torch.randn(T, H, requires_grad=True), torch.randn(V, H), torch.randint(0, V, (T,))
    lp, ent = token_logprobs(h, w, y, 7, 0.7, compiled=compiled, with_entropy=False)
    lp_ref, _ = _reference(h, w, None, y, 0.7)
    assert torch.allclose(lp.double(), lp_ref, atol=1e-5)
    assert torch.equal(ent, torch.zeros(T)) and not ent.requires_grad
    (g,) = torch.autograd.grad(lp.sum(), [h])  # logprobs stay differentiable
    (g_ref,) = torch.autograd.grad(lp_ref.sum(), [h])
    assert torch.allclose(g, g_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("tanh_scale", [None, 0.4])
def test_fused_chunk_gradient_equals_the_eager_one(dtype: torch.dtype, with_entropy: bool,
                                                   tanh_scale: float | None) -> None:
    """The compiled head's gradient formula (one-hot by comparison) against the eager one (by scatter),
    plain and softcapped."""
    torch.manual_seed(5)
    C, V, inv_temp = 9, 40, 1 / 0.7
    logits = (torch.randn(C, V) * 3).to(dtype)
    targets = torch.randint(0, V, (C,))
    _, lse, entropy = _chunk_stats(logits, targets, inv_temp, True, tanh_scale)
    g_lp, g_ent = torch.randn(C), (torch.randn(C) if with_entropy else None)
    kept = logits.clone()
    eager = _chunk_grad(logits, targets, lse, entropy, g_lp, g_ent, inv_temp, tanh_scale)
    fused = _chunk_grad_fused(logits, targets, lse, entropy, g_lp, g_ent, inv_temp, tanh_scale)
    assert torch.equal(logits, kept)  # neither form writes into kept logits
    assert fused.dtype == eager.dtype == dtype
    # float32: the same numbers up to rounding; bf16: both round one float32 result once, so within an ulp
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fused.float(), eager.float(), rtol=tol, atol=tol)
    assert float(eager.float().abs().max()) > 0.1  # a gradient that is not trivially zero


def test_entropy_does_not_depend_on_the_logits_offset() -> None:
    """Softmax ignores a constant added to every logit; the entropy must too (no lse - E[z] cancellation)."""
    torch.manual_seed(6)
    logits, targets = torch.randn(8, 300), torch.randint(0, 300, (8,))
    _, _, ent = _chunk_stats(logits, targets, 1.0)
    _, _, ent_shifted = _chunk_stats(logits + 40.0, targets, 1.0)
    ref = -(torch.log_softmax(logits.double(), -1).exp() * torch.log_softmax(logits.double(), -1)).sum(-1)
    assert torch.allclose(ent.double(), ref, atol=2e-6) and torch.allclose(ent_shifted.double(), ref, atol=2e-6)
