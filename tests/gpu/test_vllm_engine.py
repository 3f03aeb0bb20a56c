"""engine/vllm.py on a GPU: the same answers as engine/hf.py, weights updated in place, sleep and wake.

Skips without CUDA and vLLM (CI has neither). On the GPU machine:
    AGENTRL_TOKENIZER=<qwen tokenizer dir> python -m pytest -q tests/gpu -s
A random-weight Qwen2.5-0.5B-shaped model with the real Qwen2.5 tokenizer, in float32 and sharpened
(random_model.py), so that greedy choices compare the two implementations, not their bf16 rounding
(in bf16 the logprobs agree to a median 0.003, yet a quarter of 32-token greedy runs part ways at some
near-tie).
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("vllm", reason="needs vLLM (pip install agentrl[gpu])")

from agentrl.engine import Sampling  # noqa: E402
from agentrl.engine.hf import HFEngine  # noqa: E402
from agentrl.engine.vllm import VLLMEngine, vllm_processes  # noqa: E402
from tests.gpu.vllm_models import two_models_and_prompts  # noqa: E402

N_PROMPTS, NEW_TOKENS = 64, 32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tok, a, b, prompts = two_models_and_prompts(tmp_path_factory, N_PROMPTS)
    loop = asyncio.new_event_loop()
    engine = VLLMEngine(str(a), dtype="float32", gpu_memory_utilization=0.4, max_model_len=2048, enforce_eager=True,
                        enable_sleep_mode=True)
    hf_a = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).cuda()
    hf_b = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).cuda()
    yield dict(tok=tok, prompts=prompts, engine=engine, hf_a=hf_a, hf_b=hf_b, loop=loop, path_a=str(a))
    loop.run_until_complete(engine.aclose())
    loop.close()


def generate_all(loop, engine, prompts, sampling):
    async def go():
        return await asyncio.gather(*(engine.generate(p, sampling, session=f"s{i}") for i, p in enumerate(prompts)))

    return loop.run_until_complete(go())


def report(name, same, diffs):
    print(f"\n{name}: identical greedy ids {same}/{N_PROMPTS}; median |logprob diff| {statistics.median(diffs):.4f}; "
          f"p90 {sorted(diffs)[int(0.9 * len(diffs))]:.4f}")


def test_vllm_matches_hf_greedy(setup):
    s = setup
    greedy = Sampling(max_tokens=NEW_TOKENS, temperature=0)
    ours = generate_all(s["loop"], s["engine"], s["prompts"], greedy)
    theirs = generate_all(s["loop"], HFEngine(s["hf_a"], s["tok"], max_batch=N_PROMPTS), s["prompts"], greedy)
    same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs, strict=True))
    diffs = [abs(x - y) for a, b in zip(ours, theirs, strict=True) for x, y in zip(a.logprobs, b.logprobs, strict=True)
             if a.token_ids == b.token_ids]
    report("vLLM vs HF", same, diffs)
    assert same >= 0.95 * N_PROMPTS
    assert statistics.median(diffs) < 0.05


def test_sampled_logprobs_match_a_forward_pass(setup):
    """Temperature-1 samples: vLLM's logprob of each sampled token against HF's teacher-forced one."""
    s = setup
    outs = generate_all(s["loop"], s["engine"], s["prompts"][:16], Sampling(max_tokens=NEW_TOKENS, temperature=1.0, seed=7))
    diffs = []
    for p, o in zip(s["prompts"][:16], outs, strict=True):
        with torch.no_grad():
            logits = s["hf_a"](torch.tensor([p + o.token_ids], device="cuda")).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        diffs += [abs(float(lp[len(p) - 1 + i, t]) - v) for i, (t, v) in enumerate(zip(o.token_ids, o.logprobs, strict=True))]
    print(f"\nsampled tokens: median |logprob diff| {statistics.median(diffs):.4f} over {len(diffs)} tokens")
    assert statistics.median(diffs) < 0.05


def test_weight_update_in_place_then_sleep_and_wake(setup):
    s = setup
    loop, engine = s["loop"], s["engine"]
    greedy = Sampling(max_tokens=NEW_TOKENS, temperature=0)
    expected = generate_all(loop, HFEngine(s["hf_b"], s["tok"], max_batch=N_PROMPTS), s["prompts"][:16], greedy)
    before = generate_all(loop, engine, s["prompts"][:16], greedy)  # model a: the update must change these
    assert sum(x.token_ids != y.token_ids for x, y in zip(before, expected, strict=True)) >= 8
    n = loop.run_until_complete(engine.update_weights(s["hf_b"].named_parameters()))
    assert n == len(list(s["hf_b"].named_parameters()))
    after = generate_all(loop, engine, s["prompts"][:16], greedy)
    same = sum(a.token_ids == b.token_ids for a, b in zip(after, expected, strict=True))
    print(f"\nafter update to model b: {same}/16 greedy outputs equal HF's model b")
    assert same >= 15
    free_awake, total = torch.cuda.mem_get_info()
    loop.run_until_complete(engine.sleep(1))
    free_asleep = torch.cuda.mem_get_info()[0]
    # level 1 drops the KV cache and moves the weights to the host: most of the 40% the engine reserved
    assert free_asleep - free_awake > 0.25 * total, (free_awake, free_asleep, total)
    loop.run_until_complete(engine.wake())
    again = generate_all(loop, engine, s["prompts"][:16], greedy)
    assert [a.token_ids for a in again] == [a.token_ids for a in after]
    print(f"free while asleep: {free_asleep / 2**30:.1f} GiB")


def test_two_vllm_processes_behind_one_pool(setup):
    """vllm_processes: two VLLMEngines, each in a process of its own (engine/process.py), behind one
    EnginePool: the same answers as HF from both, weights updated in both (one encoding per bucket), the
    prefix cache reset there, and both children gone after aclose."""
    s = setup
    loop = s["loop"]
    greedy = Sampling(max_tokens=NEW_TOKENS, temperature=0)
    pool = vllm_processes(s["path_a"], 2, dtype="float32", gpu_memory_utilization=0.25, max_model_len=2048,
                          enforce_eager=True)
    try:
        assert pool.max_context_tokens == 2048
        assert len({id(pool.pick(f"s{i}")) for i in range(16)}) == 2  # generate_all's sessions reach both
        for hf in ("hf_a", "hf_b"):
            if hf == "hf_b":
                assert loop.run_until_complete(pool.update_weights(s["hf_b"].named_parameters())) == \
                    len(list(s["hf_b"].named_parameters()))
            ours = generate_all(loop, pool, s["prompts"][:16], greedy)
            theirs = generate_all(loop, HFEngine(s[hf], s["tok"], max_batch=16), s["prompts"][:16], greedy)
            same = sum(a.token_ids == b.token_ids for a, b in zip(ours, theirs, strict=True))
            print(f"\ntwo vLLM processes vs HF ({hf}): identical greedy ids {same}/16")
            assert same >= 15
        for engine in pool.engines:
            loop.run_until_complete(engine.call("reset_prefix_cache"))
    finally:
        loop.run_until_complete(pool.aclose())
    assert all(e.process.exitcode == 0 for e in pool.engines)
