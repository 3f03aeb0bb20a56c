"""engine/vllm.py across two GPUs: tensor parallelism and data-parallel replicas give the single-GPU
transformers answers, and an in-place weight update reaches every shard and every replica.

Skips with fewer than two GPUs or without vLLM. On a two-GPU machine:
    AGENTRL_TOKENIZER=<qwen tokenizer dir> python -m pytest -q tests/gpu/test_vllm_multi_gpu.py -s
Same random-weight, float32, sharpened model as test_vllm_engine.py, so greedy choices compare the
implementations, not rounding. Replicas are checked through sticky sessions: each prompt keeps one
session key, so its requests stay on one replica, and half the prompts land on each.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (pip install agentrl[gpu])")

from agentrl.engine import Sampling  # noqa: E402
from agentrl.engine.hf import HFEngine  # noqa: E402
from agentrl.engine.vllm import VLLMEngine  # noqa: E402
from tests.gpu.vllm_models import two_models_and_prompts, wait_for_free_gpu_memory  # noqa: E402

N_PROMPTS, NEW_TOKENS = 32, 32
GREEDY = Sampling(max_tokens=NEW_TOKENS, temperature=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tok, a, b, prompts = two_models_and_prompts(tmp_path_factory, N_PROMPTS)
    loop = asyncio.new_event_loop()
    expected = {}
    for name, path in (("a", a), ("b", b)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
        expected[name] = [c.token_ids for c in generate_all(loop, HFEngine(hf, tok, max_batch=N_PROMPTS), prompts)]
        if name == "b":
            b_weights = [(n, p.detach().cpu()) for n, p in hf.named_parameters()]
        del hf
    torch.cuda.empty_cache()
    yield dict(a=str(a), prompts=prompts, expected=expected, b_weights=b_weights, loop=loop)
    loop.close()


def generate_all(loop, engine, prompts):
    async def go():
        return await asyncio.gather(*(engine.generate(p, GREEDY, session=f"s{i}") for i, p in enumerate(prompts)))

    return loop.run_until_complete(go())


def agreement(got, expected) -> int:
    return sum(c.token_ids == e for c, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"replicas": 2}], ids=["tp2", "replicas2"])
def test_two_gpu_layout_matches_hf_and_takes_weight_updates(setup, layout):
    s = setup
    loop = s["loop"]
    wait_for_free_gpu_memory(0.6)
    engine = VLLMEngine(s["a"], dtype="float32", gpu_memory_utilization=0.3, max_model_len=2048, enforce_eager=True,
                        **layout)
    try:
        if "replicas" in layout:  # sticky routing spreads these sessions over both replicas
            ranks = {engine._rank(f"s{i}") for i in range(N_PROMPTS)}
            assert ranks == {0, 1}
        before = generate_all(loop, engine, s["prompts"])
        same_a = agreement(before, s["expected"]["a"])
        n = loop.run_until_complete(engine.update_weights(s["b_weights"]))
        assert n == len(s["b_weights"])
        after = generate_all(loop, engine, s["prompts"])
        same_b = agreement(after, s["expected"]["b"])
        print(f"\n{layout}: greedy ids equal HF's on {same_a}/{N_PROMPTS} prompts before the update (model a), "
              f"{same_b}/{N_PROMPTS} after it (model b)")
        assert same_a >= 0.95 * N_PROMPTS
        # A shard or replica the update missed answers as model a, which agrees with b on few prompts (checked
        # here), so a miss fails this bound; tensor parallelism sums in another order and can meet float
        # near-ties on a few prompts, hence not all of them.
        assert sum(a == b for a, b in zip(s["expected"]["a"], s["expected"]["b"], strict=True)) <= 0.25 * N_PROMPTS
        assert same_b >= 0.9 * N_PROMPTS
    finally:
        loop.run_until_complete(engine.aclose())
