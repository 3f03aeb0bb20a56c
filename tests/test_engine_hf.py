"""engine/hf.py: batched decoding equals one-at-a-time, logprobs are the model's, sampling is seeded,
stop strings keep the completing token, EOS and max_tokens end a request."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.engine import Sampling, stop_completed_in_last_token
from agentrl.engine.hf import HFEngine


@pytest.fixture(scope="module")
def model_and_tok(tiny_tokenizer):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tiny_tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                      eos_token_id=tiny_tokenizer.eos_token_id)
    return AutoModelForCausalLM.from_config(cfg), tiny_tokenizer


PROMPTS = ["Compute 2 + 3", "A conversation between User and Assistant.", "who wrote hamlet", "x"]


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_batched_equals_one_at_a_time_and_logprobs_are_the_models(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, tok)
    greedy = Sampling(max_tokens=12, temperature=0)

    async def both():
        together = await asyncio.gather(*(engine.generate(encode(tok, p), greedy) for p in PROMPTS))
        alone = [await engine.generate(encode(tok, p), greedy) for p in PROMPTS]
        return together, alone

    together, alone = asyncio.run(both())
    assert engine.stats["batches"] == 1 + len(PROMPTS)  # the concurrent four shared one batch
    for p, a, b in zip(PROMPTS, together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        ids = encode(tok, p)
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(model(torch.tensor([ids + a.token_ids])).logits[0].float(), -1)
        expected = [float(logprobs_TV[len(ids) - 1 + i, t]) for i, t in enumerate(a.token_ids)]
        assert a.logprobs == pytest.approx(expected, abs=1e-5)
        assert a.token_ids == [int(logprobs_TV[len(ids) - 1 + i].argmax()) for i in range(len(a.token_ids))]


def test_sampling_is_seeded_and_logprobs_follow_temperature(model_and_tok):
    model, tok = model_and_tok
    ids = encode(tok, PROMPTS[0])
    s = Sampling(max_tokens=10, temperature=0.7, seed=123)

    def sample(engine_seed, sampling):
        return asyncio.run(HFEngine(model, tok, seed=engine_seed).generate(ids, sampling))

    a, b, c = sample(0, s), sample(5, s), sample(0, s.with_(seed=124))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # the request's seed decides
    assert a.token_ids != c.token_ids
    with torch.no_grad():
        logits_TV = model(torch.tensor([ids + a.token_ids])).logits[0].float()
    expected = [float(torch.log_softmax(logits_TV[len(ids) - 1 + i] / 0.7, -1)[t]) for i, t in enumerate(a.token_ids)]
    assert a.logprobs == pytest.approx(expected, abs=1e-5)
    top1 = sample(0, Sampling(max_tokens=10, temperature=1.0, top_k=1, seed=9))
    assert top1.token_ids == sample(0, Sampling(max_tokens=10, temperature=0)).token_ids
    assert top1.logprobs == pytest.approx([0.0] * 10, abs=1e-6)  # sampled from a one-token distribution
    top2 = sample(0, Sampling(max_tokens=10, temperature=0.7, top_k=2, seed=9))
    with torch.no_grad():
        logits_TV = model(torch.tensor([ids + top2.token_ids])).logits[0].float()
    lp_TV = torch.log_softmax(logits_TV[len(ids) - 1 : -1] / 0.7, -1)
    kept_T = torch.logsumexp(torch.topk(lp_TV, 2, dim=-1).values, dim=-1)  # renormalised over the two kept
    expected = [float(lp_TV[i, t] - kept_T[i]) for i, t in enumerate(top2.token_ids)]
    assert top2.logprobs == pytest.approx(expected, abs=1e-5)


def test_waiting_requests_are_served_lowest_priority_first_then_in_arrival_order(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, tok, max_batch=2)
    finished: list[str] = []

    async def one(name: str, priority: int) -> None:
        await engine.generate(encode(tok, PROMPTS[0]), Sampling(max_tokens=3, temperature=0, priority=priority))
        finished.append(name)

    async def main() -> None:  # all five wait before the first batch is formed
        await asyncio.gather(one("a", 1), one("b", 1), one("c", 0), one("d", 0), one("e", 1))

    asyncio.run(main())
    assert engine.stats["batches"] == 3
    assert finished == ["c", "d", "a", "b", "e"]


def test_stop_strings_eos_and_max_tokens(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, tok)
    engine.eos_ids = set()  # a random model may say EOS anywhere; EOS is tested on its own below
    ids = encode(tok, PROMPTS[1])
    free = asyncio.run(engine.generate(ids, Sampling(max_tokens=20, temperature=0)))
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    # Take a piece of what the model writes greedily as the stop string: it must stop right there.
    text = tok.decode(free.token_ids)
    stop = text[len(tok.decode(free.token_ids[:5])) - 1 : len(tok.decode(free.token_ids[:6]))]
    stopped = asyncio.run(engine.generate(ids, Sampling(max_tokens=20, temperature=0, stop=(stop,))))
    assert stopped.finish_reason == "stop" and stopped.stop_str == stop
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stop in tok.decode(stopped.token_ids) and stop not in tok.decode(stopped.token_ids[:-1])
    # EOS: make the model's first greedy token the EOS id and it stops with that token kept.
    eos_engine = HFEngine(model, tok)
    eos_engine.eos_ids = {free.token_ids[0]}
    ended = asyncio.run(eos_engine.generate(ids, Sampling(max_tokens=20, temperature=0)))
    assert ended.token_ids == free.token_ids[:1] and ended.finish_reason == "stop" and ended.stop_str is None


def test_stop_completed_in_last_token():
    assert stop_completed_in_last_token("abc```output\n", "abc```out", ["```output"]) == "```output"
    assert stop_completed_in_last_token("```output and more", "```output and mor", ["```output"]) is None
    assert stop_completed_in_last_token("x</search>", "x</sea", ["</answer>", "</search>"]) == "</search>"
    assert stop_completed_in_last_token("", "", ["a"]) is None
    # a multi-byte character split between tokens: without its last byte it decodes as U+FFFD, one character
    assert stop_completed_in_last_token("answer is 5 →", "answer is 5 \ufffd", ["→"]) == "→"
    assert stop_completed_in_last_token("the end。", "the end\ufffd", ["。"]) == "。"
    assert stop_completed_in_last_token("→ then 。", "→ then \ufffd", ["→"]) is None  # the earlier one stopped already


def test_update_weights_changes_outputs_and_rejects_unknown_names(model_and_tok):
    from transformers import AutoModelForCausalLM

    model, tok = model_and_tok
    clone = AutoModelForCausalLM.from_config(model.config)
    engine = HFEngine(clone, tok)
    ids = encode(tok, PROMPTS[0])
    greedy = Sampling(max_tokens=8, temperature=0)
    reference = asyncio.run(HFEngine(model, tok).generate(ids, greedy))
    asyncio.run(engine.update_weights((n, p.detach().clone()) for n, p in model.named_parameters()))
    assert asyncio.run(engine.generate(ids, greedy)).token_ids == reference.token_ids
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        asyncio.run(engine.update_weights([("nope", torch.zeros(1))]))


def test_the_engine_window_caps_a_rollout(model_and_tok):
    """With no max_context_tokens in the budgets, the engine's window (max_position_embeddings) bounds each
    trajectory: it ends as context_limit at the window instead of asking the engine for more."""
    from agentrl.rollout import RolloutConfig, rollout
    from agentrl.task_spec import Budgets
    from agentrl.tools.formats import TorlFormat
    from agentrl.types import Prompt, StopReason

    model, tok = model_and_tok
    engine = HFEngine(model, tok)
    engine.eos_ids = set()  # a random model may say EOS anywhere: run to the limit
    engine.max_context_tokens = 40  # as if the model held 40 positions
    ids = encode(tok, "A conversation between User and Assistant. " * 2)
    assert 10 < len(ids) < 40
    budgets = Budgets(max_turns=1, max_response_tokens=200)
    (group,) = asyncio.run(rollout([Prompt("p", "", tuple(ids), "", "")], engine=engine, fmt=TorlFormat(), tools={},
                                   budgets=budgets, tokenizer=tok, config=RolloutConfig(n=1)))
    (t,) = group.trajectories
    assert t.stop_reason == StopReason.CONTEXT_LIMIT and len(ids) + len(t.response_ids) == 40
    assert budgets.max_context_tokens is None  # the caller's budgets are left as they were
    assert HFEngine(model, tok).max_context_tokens == 512  # what the model's config declares
