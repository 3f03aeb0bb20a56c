"""bench_learner's fuse_projections experiment: q/k/v and gate/up computed by one GEMM each give the model's
own outputs and gradients, on plain rows and through the learner's packed micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.learner.packing import pack
from agentrl.learner.policy import PolicyWorker
from bench.bench_learner import fuse_projections
from tests.learner_util import tiny_lm, trajectories
from tests.test_learner_worker import _config


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters()}


def test_fused_projections_give_the_models_outputs_and_gradients() -> None:
    plain = tiny_lm(seed=1, layers=3)
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 6  # an attention and an MLP per layer
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    outs = []
    for lm in (plain, fused):
        logits = lm(input_ids=ids, use_cache=False).logits
        (logits.float().pow(2).mean()).backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    a, b = _grads(plain), _grads(fused)
    assert a.keys() == b.keys() and any("q_proj" in n for n in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="no KV cache"):
        fused(input_ids=ids, use_cache=True)


def test_fused_projections_in_the_learners_packed_micro_batches() -> None:
    trajs = trajectories(8, seed=3)
    plain_lm = tiny_lm(seed=2)
    fused_lm = copy.deepcopy(plain_lm)
    fuse_projections(fused_lm)
    results = []
    for lm in (plain_lm, fused_lm):
        worker = PolicyWorker(_config(), AlgoConfig(), model=lm)
        [batch] = pack(trajs, worker.config.token_budget)
        batch.set("advantages", torch.linspace(-1, 1, len(trajs))[:, None].expand(-1, batch.max_response_len).clone())
        total = 0.0
        for mb in batch.micro_batches:
            loss, _ = worker._micro_loss(mb, batch, use_kl=False)
            loss.backward()
            total += float(loss.detach())
        results.append((total, {n: p.grad.detach().clone() for n, p in worker.module.named_parameters()}))
    assert len(batch.micro_batches) > 1
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5, abs=1e-7)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
