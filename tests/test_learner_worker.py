"""Policy, reference and critic workers in one process (FSDP over a one-rank group, CPU, fp32)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.algo.advantage import compute_advantages
from agentrl.algo.loss import aggregate, behaviour_weights, kl_penalty, ppo_clip_loss
from agentrl.engine.weights import bucket_by_bytes
from agentrl.learner.config import LearnerConfig, OptimConfig
from agentrl.learner.critic import CriticWorker
from agentrl.learner.optim import lr_factor
from agentrl.learner.packing import Batch, pack, response_layout
from agentrl.learner.policy import PolicyWorker
from agentrl.learner.reference import ReferenceWorker
from tests.learner_util import assert_fused_accumulation_is_fsdps, padded_logprobs, tiny_lm, trajectories

FULL_ALGO = dict(clip_high=0.28, dual_clip=3.0, kl={"coef": 0.1, "estimator": "k3"}, entropy_coef=0.01, tis_cap=2.0)


def _config(**kw) -> LearnerConfig:
    return LearnerConfig(device="cpu", token_budget=40, logprob_chunk_tokens=16, **kw)  # fp32 wherever it runs


def _advantages(trajs, algo: AlgoConfig) -> torch.Tensor:
    layout = response_layout(trajs)
    rewards = torch.tensor([t.reward.score for t in trajs])
    groups = torch.tensor([int(t.prompt.id[1:]) for t in trajs])
    return compute_advantages(algo, rewards, groups, layout.mask_BR)[0]


def _hf_grads(named) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in named:
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.removeprefix("lm.")] = g.detach().clone()
    return out


@pytest.mark.parametrize(("mode", "rule"), [("token_mean", "truncate"), ("seq_mean_token_mean", "truncate"),
                                           ("seq_mean_token_sum_norm", "truncate"), ("token_mean", "mask")])
def test_packed_equals_padded_loss_and_gradients(mode: str, rule: str) -> None:
    lm = tiny_lm(seed=1)
    plain = copy.deepcopy(lm)
    norm = 37 if mode == "seq_mean_token_sum_norm" else None  # Dr.GRPO's constant, not a length of the batch
    # mask: a cap inside the weights' spread here (old logprobs near -4, the engine's random), so it acts
    algo = AlgoConfig(loss_agg=mode, loss_norm_tokens=norm, tis_rule=rule,
                      **FULL_ALGO | ({"tis_cap": 0.03} if rule == "mask" else {}))
    trajs = trajectories(10, seed=4)
    worker = PolicyWorker(_config(), algo, model=lm)
    [batch] = pack(trajs, worker.config.token_budget)
    assert len(batch.micro_batches) > 2  # several micro-batches, several chunks each
    torch.manual_seed(0)
    layout = response_layout(trajs)
    adv = _advantages(trajs, algo)
    old = layout.engine_logprobs_BR * 0.1 - 4.0 + torch.randn_like(adv) * 0.3
    ref = old + torch.randn_like(adv) * 0.3
    for name, value in (("advantages", adv), ("old_logprobs", old), ("ref_logprobs", ref)):
        batch.set(name, value)

    packed_loss = 0.0
    for mb in batch.micro_batches:
        loss, _ = worker._micro_loss(mb, batch, use_kl=True)
        loss.backward()
        packed_loss += float(loss.detach())
    packed = _hf_grads((n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in worker.module.named_parameters())

    lp, ent = padded_logprobs(plain, trajs)
    mask = layout.mask_BR
    pg, _ = ppo_clip_loss(lp, old, adv, algo.clip_low, algo.clip_high, algo.dual_clip)
    weights = behaviour_weights(old, layout.engine_logprobs_BR, algo.tis_cap, rule)
    if rule == "mask":
        assert 0 < int(((weights == 0) & (mask > 0)).sum()) < int(mask.sum())  # some tokens masked, not all
    pg = pg * weights
    loss = (aggregate(pg, mask, mode, norm) + 0.1 * aggregate(kl_penalty(lp, ref, "k3"), mask, mode, norm)
            - 0.01 * aggregate(ent, mask, mode, norm))
    loss.backward()
    padded = _hf_grads(plain.named_parameters())

    assert packed_loss == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    assert packed.keys() == padded.keys()
    for name in padded:
        assert torch.allclose(packed[name], padded[name], rtol=1e-4, atol=1e-6), name


def test_tiny_model_fits_positive_advantages() -> None:
    algo = AlgoConfig(clip_high=100.0, tis_cap=None)  # the ratio may grow: the loss falls as the batch is fit
    worker = PolicyWorker(_config(optim=OptimConfig(lr=3e-3, weight_decay=0.0)), algo, model=tiny_lm(seed=2))
    trajs = trajectories(8, seed=7)
    [batch] = pack(trajs, worker.config.token_budget)
    mask = response_layout(trajs).mask_BR
    old = worker.compute_logprobs(batch)
    batch.set("advantages", mask.clone())  # +1 on every sampled token
    batch.set("old_logprobs", old)
    losses = [worker.train_step(batch)["actor/pg_loss"] for _ in range(20)]
    assert losses[0] == pytest.approx(-1.0, abs=1e-5)  # ratio 1 at the start
    assert losses[-1] < losses[0] - 0.5
    assert sum(b < a for a, b in zip(losses, losses[1:], strict=False)) >= 17  # falls (nearly) every step
    new = worker.compute_logprobs(batch)
    assert float((new * mask).sum()) > float((old * mask).sum())


def test_nan_guard_skips_and_counts() -> None:
    worker = PolicyWorker(_config(optim=OptimConfig(lr=1e-2)), AlgoConfig(), model=tiny_lm(seed=3))
    trajs = trajectories(4, seed=1)
    [batch] = pack(trajs, 1000)
    before = {n: t.clone() for n, t in worker.state_for_sync()}
    adv = response_layout(trajs).mask_BR.clone()
    adv[0, 0] = float("nan")
    batch.set("advantages", adv)
    metrics = worker.train_step(batch)
    assert metrics["actor/step_skipped"] == 1.0 and metrics["actor/skipped_steps"] == 1.0
    assert math.isnan(metrics["actor/grad_norm"])
    assert all(torch.equal(t, before[n]) for n, t in worker.state_for_sync())
    assert worker.steps == 0
    batch.set("advantages", response_layout(trajs).mask_BR)
    metrics = worker.train_step(batch)
    assert metrics["actor/step_skipped"] == 0.0 and metrics["actor/skipped_steps"] == 1.0 and worker.steps == 1
    assert not all(torch.equal(t, before[n]) for n, t in worker.state_for_sync())
    # the skipped step left no trace: moments, step counts and schedule are those of a fresh worker
    fresh = PolicyWorker(_config(optim=OptimConfig(lr=1e-2)), AlgoConfig(), model=tiny_lm(seed=3))
    fresh_metrics = fresh.train_step(batch)
    assert fresh_metrics["actor/lr"] == metrics["actor/lr"]
    expected = dict(fresh.state_for_sync())
    assert all(torch.equal(t, expected[n]) for n, t in worker.state_for_sync())


def test_a_batch_without_loss_tokens_leaves_the_weights_alone() -> None:
    # every row overlong-filtered (row scale 0): no loss tokens, so weight decay, moments and schedule stay
    worker = PolicyWorker(_config(optim=OptimConfig(lr=1e-2, weight_decay=0.1)), AlgoConfig(), model=tiny_lm(seed=3))
    trajs = trajectories(4, seed=1)
    [batch] = pack(trajs, 1000, row_scale_B=torch.zeros(4))
    assert batch.num_loss_tokens == 0
    before = {n: t.clone() for n, t in worker.state_for_sync()}
    batch.set("advantages", response_layout(trajs).mask_BR.clone())
    metrics = worker.train_step(batch)
    assert metrics["actor/step_skipped"] == 1.0 and metrics["actor/skipped_steps"] == 0.0 and worker.steps == 0
    assert all(torch.equal(t, before[n]) for n, t in worker.state_for_sync())
    [batch] = pack(trajs, 1000)
    batch.set("advantages", response_layout(trajs).mask_BR.clone())
    assert worker.train_step(batch)["actor/step_skipped"] == 0.0 and worker.steps == 1


def test_state_for_sync_and_hf_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    lm = tiny_lm(seed=4)
    plain = copy.deepcopy(lm)
    worker = PolicyWorker(_config(activation_checkpointing=True), AlgoConfig(), model=lm)
    expected = dict(plain.named_parameters())
    synced = dict(worker.state_for_sync())
    assert synced.keys() == expected.keys()  # HF names, tied head once, no wrapper prefixes
    assert all(torch.equal(synced[n], expected[n]) for n in expected)
    buckets = list(bucket_by_bytes(worker.state_for_sync(), size=40_000))
    assert len(buckets) > 1 and [n for b in buckets for n, _ in b] == list(synced)
    worker.export_hf(str(tmp_path / "hf"), dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 96, (2, 11))
    assert torch.allclose(loaded(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)
    worker.export_hf(str(tmp_path / "hf16"))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf16").dtype == torch.bfloat16
    worker.export_hf(str(tmp_path / "hf"), dtype=torch.bfloat16)  # over an earlier export: replaced whole
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "hf16"]  # nothing half-written beside them
    assert str(worker.lm.config.dtype).removeprefix("torch.") == "float32"  # the live config is left as it was


def test_checkpoint_resume_in_one_process(tmp_path: Path) -> None:
    algo = AlgoConfig()
    cfg = _config(optim=OptimConfig(lr=1e-2, warmup_steps=3))
    trajs = trajectories(6, seed=9)

    def batch_for(step: int) -> Batch:
        [batch] = pack(trajs, cfg.token_budget)
        batch.set("advantages", _advantages(trajs, algo) * (1.0 + step))
        return batch

    worker = PolicyWorker(cfg, algo, model=tiny_lm(seed=5))
    worker.train_step(batch_for(0))
    worker.end_step()
    worker.save(str(tmp_path / "ckpt"), extra={"data_position": 1})
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"model_optim", "learner.pt", "rng_rank0.pt", "COMPLETE"}
    assert (tmp_path / "ckpt" / "model_optim" / ".metadata").exists() and not (tmp_path / "ckpt.tmp").exists()
    expected = worker.train_step(batch_for(1))
    resumed = PolicyWorker(cfg, algo, model=tiny_lm(seed=6))  # other weights until loaded
    assert resumed.load(str(tmp_path / "ckpt")) == {"data_position": 1}
    got = resumed.train_step(batch_for(1))
    assert got["actor/loss"] == expected["actor/loss"]
    assert got["actor/lr"] == expected["actor/lr"] == pytest.approx(1e-2 * 2 / 3)  # second warmup step
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(worker.state_for_sync(), resumed.state_for_sync(), strict=True))


class Killed(BaseException):
    """Stands for SIGKILL at one point of a save."""


@pytest.mark.parametrize("renames_done", [1, 2])
def test_a_save_killed_while_swapping_directories_loses_nothing(tmp_path: Path, monkeypatch, renames_done) -> None:
    worker = PolicyWorker(_config(), AlgoConfig(), model=tiny_lm(seed=5))
    path = tmp_path / "ckpt"
    worker.save(str(path), extra={"data_position": 1})
    real_rename, done = Path.rename, []

    def rename(self, target):  # the first `renames_done` swaps of the next save happen, then the kill
        result = real_rename(self, target)
        if Path(target).parent == tmp_path:  # not torch.distributed.checkpoint's own renames inside
            done.append(target)
            if len(done) == renames_done:
                raise Killed
        return result

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", rename)
        with pytest.raises(Killed):
            worker.save(str(path), extra={"data_position": 2})
    resumed = PolicyWorker(_config(), AlgoConfig(), model=tiny_lm(seed=6))
    assert resumed.load(str(path)) == {"data_position": 2}  # the newer save was complete: it is the one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    worker.save(str(path), extra={"data_position": 3})  # and saving goes on as usual
    assert resumed.load(str(path)) == {"data_position": 3}


def test_a_save_before_the_first_step_changes_nothing(tmp_path: Path) -> None:
    """Reading a fresh optimizer's state would step it with zero gradients (Adam's count one ahead)."""
    algo = AlgoConfig()
    trajs = trajectories(6, seed=9)
    [batch] = pack(trajs, 40)
    batch.set("advantages", _advantages(trajs, algo))
    saved, unsaved = (PolicyWorker(_config(optim=OptimConfig(lr=1e-2)), algo, model=tiny_lm(seed=5)) for _ in range(2))
    saved.save(str(tmp_path / "step0"), extra={})
    saved.train_step(batch)
    unsaved.train_step(batch)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(saved.state_for_sync(), unsaved.state_for_sync(), strict=True))
    resumed = PolicyWorker(_config(optim=OptimConfig(lr=1e-2)), algo, model=tiny_lm(seed=6))
    resumed.load(str(tmp_path / "step0"))  # a checkpoint without optimizer state leaves the optimizer fresh
    assert not resumed.optimizer.state
    resumed.train_step(batch)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed.state_for_sync(), unsaved.state_for_sync(), strict=True))


def test_auto_fsdp_unit(monkeypatch) -> None:
    from agentrl.learner import worker as worker_module

    one = PolicyWorker(_config(), AlgoConfig(), model=tiny_lm(seed=1))
    # tiny, one rank: one unit, kept gathered through the step (freeing it after forward would save nothing)
    assert (one.fsdp_unit, one.reshard_after_forward) == ("model", False)
    assert PolicyWorker(_config(reshard_after_forward=True), AlgoConfig(),
                        model=tiny_lm(seed=1)).reshard_after_forward  # as configured
    monkeypatch.setattr(worker_module, "AUTO_MODEL_UNIT_SHARE", 0.0)  # as if all weights at once did not fit
    blocks = PolicyWorker(_config(), AlgoConfig(), model=tiny_lm(seed=1))
    assert (blocks.fsdp_unit, blocks.reshard_after_forward) == ("block", True)


@pytest.mark.parametrize("unit", ["block", "model"])
def test_reference_and_critic_workers(unit: str) -> None:
    lm = tiny_lm(seed=8)
    trajs = trajectories(6, seed=3)
    cfg = _config(optim=OptimConfig(lr=1e-2), fsdp_unit=unit)
    algo = AlgoConfig(advantage="gae", gamma=1.0, lam=0.95)
    policy = PolicyWorker(cfg, algo, model=copy.deepcopy(lm))
    reference = ReferenceWorker(cfg, model=copy.deepcopy(lm))
    [batch] = pack(trajs, cfg.token_budget)
    assert torch.allclose(reference.compute_logprobs(batch), policy.compute_logprobs(batch), atol=1e-6)
    assert reference.optimizer is None and not any(p.requires_grad for p in reference.module.parameters())

    critic = CriticWorker(cfg, algo, model=copy.deepcopy(lm))
    values = critic.compute_values(batch)
    assert float(values.abs().max()) == 0.0  # zero-initialised head
    layout = response_layout(trajs)
    rewards = torch.tensor([t.reward.score for t in trajs])
    adv, returns = compute_advantages(algo, rewards, torch.arange(6), layout.mask_BR, values)
    assert returns is not None
    batch.set("returns", returns)
    batch.set("old_values", values)
    losses = [critic.train_step(batch)["critic/value_loss"] for _ in range(6)]
    assert losses[-1] < losses[0]
    assert not any("lm_head" in n for n, _ in critic.state_for_sync())  # the vocabulary head is dropped


def test_lr_schedule() -> None:
    warm = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_factor(s, warm) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=12, min_lr_ratio=0.1)
    assert lr_factor(2, cos) == pytest.approx(1.0)
    assert lr_factor(7, cos) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, cos) == pytest.approx(0.1) and lr_factor(50, cos) == pytest.approx(0.1)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_gradient_accumulation_is_fsdps_to_the_bit(compiled: bool) -> None:
    """One FSDP unit with 16-bit compute sums each micro-batch's gradients into float32 through
    FusedGradAccumulation (fsdp.py): FSDP's own per-parameter accumulation's steps to the bit, and the fused
    path, not FSDP's, did the adding (learner_util.assert_fused_accumulation_is_fsdps)."""
    from agentrl.learner.fsdp import FusedGradAccumulation

    lm = tiny_lm(seed=3)
    config = _config(precision="bf16", fsdp_unit="model", optim=OptimConfig(lr=1e-2))
    fused = PolicyWorker(config, AlgoConfig(), model=copy.deepcopy(lm))
    plain = PolicyWorker(config, AlgoConfig(), model=lm)
    assert fused.grad_accumulation is not None and fused.compute_dtype == torch.bfloat16
    trajs = trajectories(10, seed=4)
    [batch] = pack(trajs, config.token_budget)
    batch.set("advantages", torch.randn(len(trajs), 1) * response_layout(trajs).mask_BR)
    assert_fused_accumulation_is_fsdps(fused, plain, FusedGradAccumulation(fused.module, compiled=compiled), batch)


def test_the_schedule_counts_trainer_steps_whatever_the_mini_batches(monkeypatch) -> None:
    """Cosine over 8 trainer steps of 4 mini-batches each (4 optimizer steps a step), 2 of warmup: every
    step's actor/lr and critic/lr is the formula's at that step, above zero until the last."""
    from agentrl.learn import Learner
    from agentrl.run_config import load_run_config
    from agentrl.types import Group
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)
    lr, warmup, steps, floor = 1e-3, 2, 8, 0.1
    config = load_run_config(REPO / "configs" / "debug_cpu.yaml", [
        f"trainer.steps={steps}", "trainer.mini_batches=4", "algo.advantage=gae", f"learner.optim.lr={lr}",
        f"learner.optim.warmup_steps={warmup}", "learner.optim.schedule=cosine", f"learner.optim.min_lr_ratio={floor}"])
    assert config.learner.optim.total_steps == config.critic.optim.total_steps == steps
    learner = Learner(config, tiny_lm(seed=2))
    trajs = trajectories(8, seed=3)
    groups = [Group(trajs[i].prompt, trajs[i:i + 2]) for i in range(0, 8, 2)]

    def expected(step: int) -> float:  # 1-based trainer step
        if step <= warmup:
            return lr * step / warmup
        progress = (step - 1 - warmup) / (steps - warmup)
        return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    for step in range(1, steps + 1):
        metrics = learner.learn(groups)
        assert metrics["batch/mini_batches"] == 4.0
        assert metrics["actor/lr"] == pytest.approx(expected(step), rel=1e-9), step
        assert metrics["critic/lr"] == pytest.approx(expected(step), rel=1e-9), step
        assert metrics["actor/lr"] > lr * floor if step < steps else True


@pytest.mark.parametrize("lora", [False, True])
def test_mfu_is_the_updates_flops_against_the_peak_set(lora: bool) -> None:
    """perf/actor_mfu: 6·N per token for full training (4·N plus 2 per trained parameter with a frozen base),
    over the update's own time, against learner.peak_tflops; none logged where no peak is known."""
    from agentrl.learner.config import LoraSpec

    lm = tiny_lm()
    n = sum(p.numel() for p in lm.parameters())
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"]) if lora else None
    worker = PolicyWorker(LearnerConfig(device="cpu", token_budget=4096, peak_tflops=1e-3, lora=spec), AlgoConfig(),
                          model=lm)
    trained = sum(p.numel() for p in worker.module.parameters() if p.requires_grad)
    assert worker.flops_per_token == (4 * (n + trained) + 2 * trained if lora else 6 * n)  # n: the base
    batch = pack(trajectories(4), 4096, 1)[0]
    batch.set("advantages", torch.ones_like(worker.compute_logprobs(batch)))
    m = worker.train_step(batch)
    assert m["perf/actor_mfu"] == pytest.approx(worker.flops_per_token * m["perf/actor_tokens_per_s"] / 1e9)
    plain = PolicyWorker(LearnerConfig(device="cpu", token_budget=4096), AlgoConfig(), model=tiny_lm())
    assert "perf/actor_mfu" not in plain.train_step(_with_advantages(plain, batch))


def _with_advantages(worker: PolicyWorker, batch: Batch) -> Batch:
    batch.set("advantages", torch.ones_like(worker.compute_logprobs(batch)))
    return batch


@pytest.mark.parametrize(("name", "tflops"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                              ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                              ("NVIDIA H100 NVL", 835.0), ("NVIDIA L40", 181.0),
                                              ("NVIDIA L4", 121.0), ("Some Other GPU", None)])
def test_known_gpus_peaks_are_built_in_and_a_set_peak_wins(monkeypatch, name: str, tflops: float | None) -> None:
    from agentrl.learner.worker import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops(torch.device("cuda"), None) == (tflops * 1e12 if tflops else None)
    assert peak_flops(torch.device("cuda"), 500.0) == 500e12
    assert peak_flops(torch.device("cpu"), None) is None
