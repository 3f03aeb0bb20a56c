"""Packed attention (agentrl/learner/attention.py): exact on CPU; the GPU (varlen) path traces whole."""

from __future__ import annotations

import pytest
import torch

from agentrl.learner import attention
from agentrl.learner.attention import enable_packed_attention, packed_attention
from tests.learner_util import tiny_lm


def test_packed_attention_equals_block_diagonal_causal_mask() -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    T, Hq, Hkv, D = sum(lengths), 4, 2, 8
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths))
    assert out.shape == (1, T, Hq, D)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(T)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    kr, vr = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    scores = (q @ kr.transpose(-1, -2)) * 0.3
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vr
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)


def test_sliding_window_models_are_refused() -> None:
    lm = tiny_lm()
    lm.config.use_sliding_window = True
    with pytest.raises(ValueError, match="sliding"):
        enable_packed_attention(lm)


def test_padding_masks_are_refused() -> None:
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no attention mask"):
        packed_attention(None, x, x, x, torch.ones(1, 1, 4, 4))


def test_varlen_path_compiles_without_graph_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU path (flash2: the aten FlashAttention op itself, dynamic shapes) a decoder block, as
    fsdp.shard compiles it, is captured as one graph with one attention call on k/v of their own (fewer)
    heads: nothing repeats them. Traced on CPU: dynamo only needs the op's meta implementation, so the
    capture is checked without a GPU."""
    lm = tiny_lm().to(torch.bfloat16)
    enable_packed_attention(lm)
    monkeypatch.setattr(attention, "_VARLEN", attention._flash2)  # as resolved on a CUDA build with flash
    monkeypatch.setattr(attention, "_varlen_for", lambda query: attention._VARLEN)  # the CUDA branch
    captured = _captured_block_graphs(lm)
    calls = sum("_flash_attention_forward" in t for t in captured[0]) if captured else 0
    assert len(captured) == 1 and calls == 1
    assert not any("repeat" in t or "expand" in t for t in captured[0])


def test_fa4_kernel_is_one_opaque_op_in_the_compiled_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """learner.attention_kernel=fa4: the block still captures as one graph, with the attention as one
    agentrl::fa4_varlen call whose fake shapes (output like q, log-sum-exp [heads, T]; gradients like
    q, k, v) are what the flash-attn-4 kernels return. Needs no GPU and no flash-attn-4: tracing runs the
    fake implementations only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lm = tiny_lm().to(torch.bfloat16)
    enable_packed_attention(lm)
    monkeypatch.setattr(attention, "_VARLEN", attention._fa4)
    monkeypatch.setattr(attention, "_varlen_for", lambda query: attention._VARLEN)
    captured = _captured_block_graphs(lm)
    assert len(captured) == 1 and sum("fa4_varlen" in t for t in captured[0]) == 1

    with FakeTensorMode():
        q, k, v = torch.empty(20, 4, 16, dtype=torch.bfloat16), *(torch.empty(20, 2, 16, dtype=torch.bfloat16),) * 2
        cu_fake = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.agentrl.fa4_varlen(q, k, v, cu_fake, 12, 0.25)
        dq, dk, dv = torch.ops.agentrl.fa4_varlen_backward(out, q, k, v, out, lse, cu_fake, 12, 0.25)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (4, 20) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_a_kernel_that_is_not_installed_is_refused() -> None:
    lm = tiny_lm()
    if attention._resolve_varlen("fa4") is None:
        with pytest.raises(ValueError, match="'fa4' is not installed"):
            enable_packed_attention(lm, "fa4")
    with pytest.raises(ValueError, match="unknown packed-attention kernel 'fa5'"):
        enable_packed_attention(lm, "fa5")


def _captured_block_graphs(lm) -> list[list[str]]:
    """The graphs dynamo captures for decoder block 0 on a packed row (fullgraph, dynamic shapes): the
    targets of each graph's nodes. Stops at capture: no kernel runs, only fake implementations."""
    pos = torch.tensor([list(range(12)) + list(range(8))])
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)
    captured = []

    class Captured(Exception):
        pass

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> None:
        captured.append([str(n.target) for n in gm.graph.nodes])
        raise Captured

    h = torch.randn(1, 20, 64, dtype=torch.bfloat16)
    cos, sin = lm.model.rotary_emb(h, pos)

    def run(x, cu, m):
        return lm.model.layers[0](x, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos,
                                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="Captured"):
        torch.compile(run, fullgraph=True, dynamic=True, backend=backend)(h, cu, 12)
    torch._dynamo.reset()
    return captured
