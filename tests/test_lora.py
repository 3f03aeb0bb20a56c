"""LoRA (agentrl/learner/lora.py): the adapter trains on the frozen base, syncs alone into the engine and is
checked there, the reference is the base with the adapter off, checkpoints hold the adapter and resume, the
export holds the merged model and the adapter, and `agentrl eval` serves either."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch

from agentrl.algo import AlgoConfig
from agentrl.config import ConfigError
from agentrl.engine import Sampling
from agentrl.engine.hf import HFEngine
from agentrl.learner import lora
from agentrl.learner.config import LearnerConfig, LoraSpec, OptimConfig
from agentrl.learner.packing import pack
from agentrl.learner.policy import PolicyWorker
from agentrl.types import Prompt, Segment, StopReason, Trajectory
from tests.learner_util import padded_logprobs, tiny_lm, trajectories

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def policy(lm=None, lr=0.05, spec=SPEC, **kw) -> PolicyWorker:
    config = LearnerConfig(device="cpu", token_budget=4096, lora=spec, optim=OptimConfig(lr=lr, weight_decay=0.0), **kw)
    return PolicyWorker(config, AlgoConfig(), model=lm if lm is not None else tiny_lm())


def step(worker: PolicyWorker, seed: int = 0) -> None:
    """One update that moves the adapter: advantages of random sign on random trajectories."""
    batch = pack(trajectories(6, seed=seed), 4096, 1)[0]
    lp = worker.compute_logprobs(batch)
    batch.set("advantages", torch.randn(lp.shape, generator=torch.Generator().manual_seed(seed)))
    worker.train_step(batch)
    worker.end_step()


class TinyTok:
    """Enough of a tokenizer for HFEngine over ids: no EOS is ever sampled (id -1), nothing decodes."""

    eos_token_id, pad_token_id = -1, 0

    def decode(self, ids):
        return ""


def engine_of(lm) -> HFEngine:
    return HFEngine(lora.add_lora(copy.deepcopy(lm), SPEC), TinyTok(), seed=0)


def probe(engine: HFEngine, worker: PolicyWorker, tokens: int = 12) -> float:
    """The engine samples `tokens`, the learner scores them: the largest logprob gap."""
    prompt_ids = [5, 9, 17, 33]
    c = asyncio.run(engine.generate(prompt_ids, Sampling(max_tokens=tokens, temperature=1.0, seed=3)))
    t = Trajectory(Prompt("p", "", tuple(prompt_ids), "", ""), [Segment("model", c.token_ids, c.logprobs)],
                   StopReason.EOS)
    learner = worker.compute_logprobs(pack([t], 4096, 1)[0])[0, : len(c.token_ids)]
    return float((learner - torch.tensor(c.logprobs)).abs().max())


async def push(worker: PolicyWorker, engine: HFEngine) -> list[str]:
    named = list(worker.state_for_sync())
    await engine.update_weights(named)
    return [n for n, _ in named]


def test_only_the_adapter_trains_and_the_base_is_kept_in_the_compute_dtype():
    worker = policy(precision="bf16")
    trained = {n for n, p in worker.module.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert {p.dtype for n, p in worker.module.named_parameters() if n not in trained} == {torch.bfloat16}
    assert {p.dtype for n, p in worker.module.named_parameters() if n in trained} == {torch.float32}
    assert sum(len(g["params"]) for g in worker.optimizer.param_groups) == len(trained)


def test_the_base_can_score_before_the_first_update_in_bf16():
    """The reference pass (the adapter off) may be the model's first forward; FSDP then sets up its
    gradients, which must still be the adapter's (adapter_off leaves requires_grad as it was)."""
    worker = policy(precision="bf16")
    worker.compute_base_logprobs(pack(trajectories(4), 4096, 1)[0])
    step(worker)
    assert all(p.requires_grad for n, p in worker.module.named_parameters() if lora.is_adapter(n))
    assert worker.steps == 1


def test_an_engines_base_is_rounded_as_a_bf16_learner_keeps_it():
    model = lora.add_lora(tiny_lm(), SPEC)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.round_base(model, torch.bfloat16)
    for n, p in model.named_parameters():
        expected = before[n] if lora.is_adapter(n) else before[n].to(torch.bfloat16).float()
        assert p.dtype == torch.float32 and torch.equal(p, expected), n


def test_the_engine_agrees_with_the_learner_before_and_after_an_adapter_sync():
    lm = tiny_lm()
    engine, worker = engine_of(lm), policy(copy.deepcopy(lm))
    names = asyncio.run(push(worker, engine))
    assert names and all(lora.is_adapter(n) for n in names)  # the adapter only: 2 tensors per adapted module
    assert len(names) == 2 * 3 * 2  # (A, B) x (q, v, down) x 2 layers
    assert probe(engine, worker) < 1e-5
    step(worker)
    assert probe(engine, worker) > 1e-3  # the adapter moved; the engine still has the old one
    asyncio.run(push(worker, engine))
    assert probe(engine, worker) < 1e-5


def test_fifty_syncs_leave_the_engine_holding_one_adapter():
    lm = tiny_lm()
    engine, worker = engine_of(lm), policy(copy.deepcopy(lm))
    before = sum(p.numel() for p in engine.model.parameters())
    for i in range(50):
        if i % 10 == 0:
            step(worker, seed=i)
        asyncio.run(push(worker, engine))
    assert lora.adapter_names(engine.model) == {lora.ADAPTER}
    assert sum(p.numel() for p in engine.model.parameters()) == before
    assert probe(engine, worker) < 1e-5


def test_the_reference_is_the_base_model_with_the_adapter_off():
    lm = tiny_lm()
    worker = policy(copy.deepcopy(lm))
    for seed in range(2):
        step(worker, seed)
    trajs = trajectories(6, seed=7)
    batch = pack(trajs, 4096, 1)[0]
    base, adapted = worker.compute_base_logprobs(batch), worker.compute_logprobs(batch)
    expected, _ = padded_logprobs(lm, trajs)
    for b, t in enumerate(trajs):
        n = len(t.response_ids)
        assert torch.allclose(base[b, :n], expected[b, :n], atol=1e-5)
    assert float((adapted - base).abs().max()) > 1e-3  # and the adapter is back on afterwards


def test_a_checkpoint_holds_the_adapter_and_its_optimizer_and_resumes_exactly(tmp_path):
    lm = tiny_lm()
    worker = policy(copy.deepcopy(lm))
    step(worker, 0)
    worker.save(str(tmp_path / "ckpt"), extra={"at": 1})
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "ckpt/model_optim")).read_metadata().state_dict_metadata
    weights = [k.removeprefix("model.") for k in saved if k.startswith("model.")]
    assert weights and [k for k in weights if not lora.is_adapter(k)] == []  # the base is the model's own
    assert any(k.startswith("optim.state.") for k in saved)
    resumed = policy(copy.deepcopy(lm))
    assert resumed.load(str(tmp_path / "ckpt")) == {"at": 1}
    step(worker, 1)
    step(resumed, 1)
    batch = pack(trajectories(4, seed=9), 4096, 1)[0]
    assert torch.equal(worker.compute_logprobs(batch), resumed.compute_logprobs(batch))
    full = PolicyWorker(LearnerConfig(device="cpu", token_budget=4096), AlgoConfig(), model=copy.deepcopy(lm))
    with pytest.raises(ValueError, match="do not fit this model .*was model.lora changed"):
        full.load(str(tmp_path / "ckpt"))


def test_the_export_is_the_merged_model_with_the_adapter_beside_it_and_eval_serves_either(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.build import checkpoint_engine
    from tests.conftest import make_tiny_tokenizer

    lm = tiny_lm(vocab=512)
    base_dir = tmp_path / "base"
    lm.save_pretrained(base_dir)
    worker = policy(copy.deepcopy(lm), model=str(base_dir))
    for seed in range(2):
        step(worker, seed)
    worker.export_hf(str(tmp_path / "export"), dtype=torch.float32, tokenizer=make_tiny_tokenizer())
    trajs = trajectories(4, seed=3)
    expected = worker.compute_logprobs(pack(trajs, 4096, 1)[0])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    config = json.loads((tmp_path / "export/adapter/adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(base_dir.resolve())
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                        str(tmp_path / "export/adapter"))
    for model in (merged, adapted, checkpoint_engine("hf", str(tmp_path / "export/adapter"), seed=0).model):
        got, _ = padded_logprobs(model, trajs)
        for b, t in enumerate(trajs):
            n = len(t.response_ids)
            assert torch.allclose(got[b, :n], expected[b, :n], atol=1e-4)


def test_a_target_module_the_model_lacks_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qkv'\] is not a Linear module of this "
                                          r"model; its Linear modules are: q_proj, k_proj, v_proj, o_proj"):
        policy(spec=LoraSpec(target_modules=["q_proj", "qkv"]))


# --- through the trainer (configs/debug_cpu.yaml) ---------------------------------------------------------

LORA_RUN = ("model.lora.rank=4", "model.lora.alpha=8", "trainer.eval_every=0", "trainer.samples_per_step=0",
            "learner.optim.lr=0.01", "algo.entropy_coef=0.05")


@pytest.fixture
def in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("advantage", ["grpo", pytest.param("gae", marks=pytest.mark.slow)])  # gae: the critic's own adapter
def test_a_lora_run_pushes_only_the_adapter_checks_every_push_and_exports_both(tmp_path, in_repo, advantage):
    from agentrl.build import build_lm
    from agentrl.trainer import train
    from tests.test_trainer import config, read_jsonl

    cfg = config(tmp_path, "trainer.steps=2", f"algo.advantage={advantage}", *LORA_RUN)
    adapter_bytes = 4 * sum(p.numel() for n, p in lora.add_lora(build_lm(cfg), cfg.model.lora).named_parameters()
                            if lora.is_adapter(n))
    run = train(cfg).root
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["sync/bytes"] for m in metrics] == [adapter_bytes] * 2  # float32 on the CPU
    assert all(m["sync/probe_gap"] < 1e-4 for m in metrics)
    assert all(("critic/value_loss" in m) == (advantage == "gae") for m in metrics)
    assert (run / "export/config.json").exists() and (run / "export/adapter/adapter_config.json").exists()


def test_an_async_lora_run_tags_each_segment_with_the_adapter_version_that_sampled_it(tmp_path, in_repo):
    """Asynchronous training with an adapter: rollouts run while the learner trains, each push swaps the
    engine's adapter (checked), and every sampled segment names the version that sampled it, never older
    than the staleness bound allows; a response that spans a push has both versions, in order."""
    from agentrl.trainer import train
    from tests.test_trainer import config, read_jsonl

    cfg = config(tmp_path, *LORA_RUN, "trainer.steps=3", "trainer.mode=async", "trainer.max_staleness=1",
                 "trainer.samples_per_step=64", "trainer.chunk_tokens=4", "trainer.export=false", "trainer.save_every=0")
    run = train(cfg).root
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["sync/probe_gap"] < 1e-4 for m in metrics)  # each step's adapter is the one the engine serves
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    for step in (1, 2, 3):
        for sample in read_jsonl(run / f"samples/step_{step}.jsonl"):
            versions = [seg["version"] for seg in sample["segments"] if seg["source"] == "model"]
            # a response in flight at a push goes on under the new adapter (4-token requests), tagged so
            assert versions == sorted(versions) and all(step - 2 <= v <= step - 1 for v in versions), (step, versions)


@pytest.mark.slow
def test_a_lora_push_that_never_arrives_fails_the_run(tmp_path, in_repo, monkeypatch):
    from agentrl.learn import Learner
    from agentrl.trainer import train
    from tests.test_trainer import config

    async def lost(self, engine):
        return {"timing/weight_sync": 0.0}

    monkeypatch.setattr(Learner, "push", lost)
    with pytest.raises(RuntimeError, match=r"after the weight push \(tensors\) engine 0's logprobs"):
        train(config(tmp_path, "trainer.steps=3", "trainer.export=false", "trainer.save_every=0", *LORA_RUN))


@pytest.mark.slow
def test_a_resumed_lora_run_continues_as_one_that_never_stopped(tmp_path, in_repo):
    from agentrl.trainer import train
    from tests.test_trainer import config, read_jsonl

    sets = ("trainer.export=false", "trainer.save_every=1", *LORA_RUN)
    whole = read_jsonl(train(config(tmp_path, "trainer.steps=3", *sets, name="whole")).root / "metrics.jsonl")
    train(config(tmp_path, "trainer.steps=2", *sets, name="cut"))
    resumed = read_jsonl(train(config(tmp_path, "trainer.steps=3", *sets, name="cut")).root / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert resumed[2]["actor/loss"] == pytest.approx(whole[2]["actor/loss"], rel=1e-5)
    assert resumed[2]["reward/mean"] == whole[2]["reward/mean"]


def test_a_vllm_engines_adapter_is_written_as_peft_writes_it_from_the_pushed_buckets(tmp_path):
    """engine/vllm.py's `_Adapter` collects a push's buckets and writes the adapter that vLLM loads (its
    LoRA loader reads peft's format): loaded by peft onto the base, it gives the learner's adapted model."""
    from peft import PeftModel

    from agentrl.engine.vllm import _Adapter
    from agentrl.engine.weights import bucket_by_bytes, encode_bucket

    worker = policy()
    step(worker)
    adapter = _Adapter(SPEC.model_dump())
    pushed = list(worker.state_for_sync())
    assert sum(adapter.take(encode_bucket(b)) for b in bucket_by_bytes(iter(pushed), 4096)) == len(pushed)
    with pytest.raises(ValueError, match="adapter tensors only"):
        adapter.take(encode_bucket([("model.embed_tokens.weight", torch.zeros(2, 2))]))
    path = adapter.write()
    assert adapter.tensors == {} and path.parent == adapter.root
    orphan = adapter.root.with_name(f"agentrl-lora-{2**22 + 7}-x")  # a pid above the kernel's limit: not running
    orphan.mkdir()
    _Adapter(SPEC.model_dump())  # a new engine's adapter removes what dead engines left, and keeps the living's
    assert not orphan.exists() and path.exists()
    served = PeftModel.from_pretrained(tiny_lm(), str(path)).eval()  # the base: the policy's seeded start
    learners = lora.add_lora(tiny_lm(), SPEC).eval()
    missing, unexpected = learners.load_state_dict(dict(pushed), strict=False)
    assert unexpected == [] and not [n for n in missing if lora.is_adapter(n)]
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        theirs, ours = served(input_ids=ids).logits, learners(input_ids=ids).logits
        base = tiny_lm()(input_ids=ids).logits
    assert torch.allclose(theirs, ours, atol=1e-5) and not torch.allclose(base, ours, atol=1e-3)
    with pytest.raises(ValueError, match="brought no adapter tensors"):
        adapter.write()
