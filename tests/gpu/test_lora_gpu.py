"""LoRA served by vLLM on a GPU (engine/vllm.py's `_Adapter`): base + adapter gives the logprobs a peft model
of the same weights gives, each push replaces the one adapter the engine holds, the adapter survives sleep
and wake, and a colocated `agentrl train` run with model.lora pushes only the adapter and checks every push.

Skips without CUDA and vLLM (CI has neither). On the GPU machine:
    AGENTRL_TOKENIZER=<qwen tokenizer dir> python -m pytest -q tests/gpu/test_lora_gpu.py -s
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (pip install agentrl[gpu])")

from agentrl.engine import Sampling  # noqa: E402
from agentrl.engine.vllm import VLLMEngine  # noqa: E402
from agentrl.learner import lora  # noqa: E402
from agentrl.learner.config import LoraSpec  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.gpu.vllm_models import two_models_and_prompts  # noqa: E402

SPEC = LoraSpec(rank=16, alpha=32)
TOKENS = 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tok, a, _, prompts = two_models_and_prompts(tmp_path_factory, 16)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(a), dtype="bfloat16", gpu_memory_utilization=0.12, max_model_len=2048, enforce_eager=True,
                        enable_sleep_mode=True, lora=SPEC.model_dump())
    hf = lora.add_lora(AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32), SPEC).cuda()
    lora.round_base(hf, torch.bfloat16)  # what the engine's bf16 base holds
    yield dict(tok=tok, prompts=prompts, engine=engine, hf=hf, loop=loop)
    loop.run_until_complete(engine.aclose())
    loop.close()


def set_adapter(hf, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random adapter weights (B non-zero, so the adapter changes the model), rounded to bf16 as a bf16 learner
    pushes them; the tensors a push sends."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if lora.is_adapter(name):
                p.copy_((torch.randn(p.shape, generator=g) * (0.05 if ".lora_B." in name else 0.02)).to(torch.bfloat16))
    return [(n, p.detach().to(torch.bfloat16)) for n, p in hf.named_parameters() if lora.is_adapter(n)]


def gaps(s, with_adapter: bool = True) -> list[float]:
    """|engine logprob - HF logprob| of every token the engine samples (temperature 1) from the 16 prompts."""
    async def go():
        return await asyncio.gather(*(s["engine"].generate(p, Sampling(max_tokens=TOKENS, seed=i), session=f"s{i}")
                                      for i, p in enumerate(s["prompts"])))

    out = []
    for p, c in zip(s["prompts"], s["loop"].run_until_complete(go()), strict=True):
        ids = torch.tensor([p + c.token_ids], device="cuda")
        with torch.no_grad():
            if with_adapter:
                logits = s["hf"](ids).logits[0].float()
            else:
                with lora.adapter_off(s["hf"]):
                    logits = s["hf"](ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        out += [abs(float(lp[len(p) - 1 + i, t]) - v) for i, (t, v) in enumerate(zip(c.token_ids, c.logprobs, strict=True))]
    return out


def test_the_engine_serves_the_pushed_adapter_and_holds_one_however_many_pushes(setup):
    s = setup
    before = gaps(s, with_adapter=False)  # no push yet: the base alone
    print(f"\nbase, before any push: median |logprob diff| {statistics.median(before):.4f}")
    assert statistics.median(before) < 0.05
    tensors = set_adapter(s["hf"], seed=0)
    assert s["loop"].run_until_complete(s["engine"].update_weights(tensors)) == len(tensors)
    served, base = gaps(s), gaps(s, with_adapter=False)
    print(f"after a push: median |logprob diff| against the adapted model {statistics.median(served):.4f}, "
          f"against the base {statistics.median(base):.4f}")
    assert statistics.median(served) < 0.05
    assert statistics.median(base) > 4 * statistics.median(served)  # the adapter took effect
    for seed in range(1, 51):  # 50 more pushes, each a different adapter
        s["loop"].run_until_complete(s["engine"].update_weights(set_adapter(s["hf"], seed)))
    assert s["loop"].run_until_complete(s["engine"].adapters_loaded()) == 1
    last = gaps(s)
    print(f"after 51 pushes: median |logprob diff| {statistics.median(last):.4f}")
    assert statistics.median(last) < 0.05  # the last push's adapter, not an earlier one


def test_the_adapter_survives_sleep_and_wake(setup):
    s = setup
    s["loop"].run_until_complete(s["engine"].update_weights(set_adapter(s["hf"], seed=99)))
    s["loop"].run_until_complete(s["engine"].sleep(1))
    s["loop"].run_until_complete(s["engine"].wake())
    after = gaps(s)
    print(f"\nafter sleep and wake: median |logprob diff| {statistics.median(after):.4f}")
    assert statistics.median(after) < 0.05


def test_a_colocated_lora_run_pushes_the_adapter_and_checks_every_push(tmp_path, monkeypatch):
    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer
    from tests.gpu.test_trainer_gpu import _run_and_compare, gpu_run_config, init_tensors

    monkeypatch.chdir(REPO)
    config = load_run_config(gpu_run_config(tmp_path, steps=3, prompts=8, n=4),  # beside the module's engine
                             ["model.lora.rank=16", "model.lora.alpha=32", "learner.optim.lr=2e-3",
                              "engine.gpu_memory_utilization=0.15"])
    engine_gap, stale_gap = asyncio.run(_run_and_compare(Trainer(config)))
    print(f"\nafter the run: engine against learner {engine_gap:.4f}, initial weights against learner {stale_gap:.4f}")
    run = Path(config.run_dir)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    full_bytes = 2 * sum(t.numel() for t in init_tensors(run))
    for m in metrics:
        assert m["sync/probe_gap"] < config.trainer.probe_tolerance
        assert 0 < m["sync/bytes"] < 0.05 * full_bytes  # the adapter only
    assert engine_gap < 0.05
    assert (run / "export" / "adapter" / "adapter_config.json").is_file()
