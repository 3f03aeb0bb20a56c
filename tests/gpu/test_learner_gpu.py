"""GPU smoke for the learner (skipped without CUDA): packed bf16 training on the varlen flash path agrees
with a padded transformers forward, compiled agrees with eager, float32 falls back to exact SDPA.

    python3 -m pytest -q tests/gpu/test_learner_gpu.py        # on the GPU machine, from the repo root

bf16 tolerances are relative to a float32 reference: the packed path may not be worse than 2x (plus a
small floor) the error of transformers' own padded bf16 forward.
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.algo.loss import aggregate, ppo_clip_loss
from agentrl.learner.attention import _resolve_varlen, packed_backend
from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import pack, response_layout
from agentrl.learner.policy import PolicyWorker
from tests.learner_util import assert_fused_accumulation_is_fsdps, padded_logprobs, tiny_lm, trajectories

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 4096
NEEDS_FA4 = pytest.mark.skipif(_resolve_varlen("fa4") is None, reason="flash-attn-4 is not installed (pip install flash-attn-4)")
KERNELS = ["flash2", pytest.param("fa4", marks=NEEDS_FA4)]


def _setup(seed: int = 0):
    lm = tiny_lm(seed=seed, layers=4, vocab=VOCAB, hidden=256, device="cuda")
    trajs = trajectories(24, seed=seed, max_prompt=60, max_turn=120, vocab=VOCAB)
    return lm, trajs


def _advantages(trajs) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(len(trajs), 1) * response_layout(trajs).mask_BR


def _padded_grads(lm, trajs, adv) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lp, _ = padded_logprobs(lm, trajs)
    mask = response_layout(trajs).mask_BR
    loss = aggregate(ppo_clip_loss(lp, lp.detach(), adv)[0], mask, "token_mean")
    loss.backward()
    return lp.detach(), {n: p.grad.float().flatten() for n, p in lm.named_parameters()}


def _packed_grads(worker: PolicyWorker, batch) -> dict[str, torch.Tensor]:
    for mb in batch.micro_batches:
        loss, _ = worker._micro_loss(mb.to(worker.ctx.device), batch, use_kl=False)
        loss.backward()
    out = {}
    for name, p in worker.module.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "").removeprefix("lm.")
        out[name] = p.grad.full_tensor().float().flatten()
    worker.optimizer.zero_grad(set_to_none=True)
    return out


def _rel_err(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([a[n] - ref[n] for n in ref])
    return float(diff.norm() / torch.cat(list(ref.values())).norm())


@pytest.mark.parametrize("kernel", KERNELS)
def test_packed_bf16_matches_padded_transformers(kernel: str) -> None:
    assert packed_backend(torch.device("cuda"), kernel).startswith("varlen"), f"{kernel} varlen is missing"
    lm, trajs = _setup()
    fp32_ref, bf16_ref = copy.deepcopy(lm), copy.deepcopy(lm).to(torch.bfloat16)
    worker = PolicyWorker(LearnerConfig(device="cuda", token_budget=512, logprob_chunk_tokens=256,
                                        attention_kernel=kernel), AlgoConfig(), model=lm)
    assert worker.compute_dtype == torch.bfloat16
    [batch] = pack(trajs, 512)
    assert len(batch.micro_batches) > 2
    adv = _advantages(trajs)
    batch.set("advantages", adv)
    mask = response_layout(trajs).mask_BR > 0

    packed = worker.compute_logprobs(batch)
    truth, g_truth = _padded_grads(fp32_ref, trajs, adv)
    padded, g_padded = _padded_grads(bf16_ref, trajs, adv)
    err_packed = (packed - truth)[mask].abs()
    err_padded = (padded - truth)[mask].abs()
    print(f"logprob error vs fp32: packed mean {err_packed.mean():.2e} max {err_packed.max():.2e}; "
          f"transformers bf16 mean {err_padded.mean():.2e} max {err_padded.max():.2e}")
    assert float(err_packed.mean()) <= 2 * float(err_padded.mean()) + 1e-3
    assert float(err_packed.max()) <= 3 * float(err_padded.max()) + 1e-2

    g_packed = _packed_grads(worker, batch)
    rel_packed, rel_padded = _rel_err(g_packed, g_truth), _rel_err(g_padded, g_truth)
    print(f"gradient relative error vs fp32: packed {rel_packed:.2e}, transformers bf16 {rel_padded:.2e}")
    assert rel_packed <= 2 * rel_padded + 0.02

    metrics = worker.train_step(batch)
    assert metrics["actor/step_skipped"] == 0.0 and torch.isfinite(torch.tensor(metrics["actor/loss"]))


@pytest.mark.parametrize("unit,kernel,checkpointed", [("block", "flash2", True), ("block", "flash2", False),
                                                      ("model", "flash2", True), ("model", "flash2", False),
                                                      pytest.param("model", "fa4", False, marks=NEEDS_FA4)])
def test_compiled_matches_eager(unit: str, kernel: str, checkpointed: bool) -> None:
    """Compiled block by block, under per-block FSDP units or one root unit (fsdp_unit="model"); with fa4
    the attention ops run inside the compiled blocks as opaque custom ops. Without activation
    checkpointing the blocks are built with inductor's C++ wrapper (fsdp.compile_options), with it the
    Python one: both are checked."""
    lm, trajs = _setup(seed=1)
    config = dict(device="cuda", token_budget=512, logprob_chunk_tokens=256, attention_kernel=kernel)
    eager = PolicyWorker(LearnerConfig(**config), AlgoConfig(), model=copy.deepcopy(lm))
    compiled = PolicyWorker(LearnerConfig(compile=True, activation_checkpointing=checkpointed, fsdp_unit=unit, **config),
                            AlgoConfig(), model=lm)
    [batch] = pack(trajs, 512)
    batch.set("advantages", _advantages(trajs))
    mask = response_layout(trajs).mask_BR > 0
    diff = (compiled.compute_logprobs(batch) - eager.compute_logprobs(batch))[mask].abs()
    print(f"compiled vs eager logprobs: mean {diff.mean():.2e} max {diff.max():.2e}")
    assert float(diff.mean()) < 2e-2 and float(diff.max()) < 0.25
    for _ in range(2):  # the second step runs on weights the first one changed
        m_c, m_e = compiled.train_step(batch), eager.train_step(batch)
    assert m_c["actor/loss"] == pytest.approx(m_e["actor/loss"], abs=2e-2)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_gradient_accumulation_matches_fsdps_on_cuda(compiled: bool) -> None:
    """One FSDP unit, bf16 compute: the fused float32 accumulation (fsdp.FusedGradAccumulation), whose
    callback runs on the autograd engine's device thread, takes FSDP's own per-parameter steps to the bit
    on the GPU too, and it, not FSDP, did the adding."""
    from agentrl.learner.fsdp import FusedGradAccumulation

    lm, trajs = _setup(seed=3)
    config = LearnerConfig(device="cuda", token_budget=512, logprob_chunk_tokens=256, fsdp_unit="model")
    fused = PolicyWorker(config, AlgoConfig(), model=copy.deepcopy(lm))
    plain = PolicyWorker(config, AlgoConfig(), model=lm)
    [batch] = pack(trajs, 512)
    batch.set("advantages", _advantages(trajs))
    assert_fused_accumulation_is_fsdps(fused, plain, FusedGradAccumulation(fused.module, compiled=compiled), batch)


def test_fp32_on_cuda_is_exact() -> None:
    lm, trajs = _setup(seed=2)
    ref = copy.deepcopy(lm)
    worker = PolicyWorker(LearnerConfig(device="cuda", precision="fp32", token_budget=512), AlgoConfig(), model=lm)
    [batch] = pack(trajs, 512)
    mask = response_layout(trajs).mask_BR > 0
    with torch.no_grad():
        truth, _ = padded_logprobs(ref, trajs)
    diff = (worker.compute_logprobs(batch) - truth)[mask].abs()
    assert float(diff.max()) < 1e-3  # TF32 may be on for matmuls; attention is per-sequence SDPA in fp32
