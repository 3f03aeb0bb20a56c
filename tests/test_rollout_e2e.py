"""The whole rollout for real: a tiny transformers model on engine/hf.py calls the real sandbox and the real
retriever over loopback HTTP, and the trajectories come back graded.

A random model never writes a tool call, so the model is first taught two transcripts (a few seconds of
training on CPU): a ToRL one that runs `print(6 * 7)` and answers \\boxed{42}, and a Search-R1 one that
searches and answers Paris. The transcripts are built from the services' real answers rendered by the
real formats, and tokenized piece by piece exactly as the rollout will see them; greedy decoding then
reproduces them through the real loop, services, stop strings and rewards.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from agentrl.engine.hf import HFEngine
from agentrl.rewards import build_reward
from agentrl.rollout import RolloutConfig, rollout
from agentrl.task_spec import Budgets
from agentrl.tools.code import CodeTool
from agentrl.tools.formats import SearchR1Format, TorlFormat
from agentrl.tools.search import SearchTool
from agentrl.types import Prompt, StopReason, ToolCall
from tests.conftest import REPO
from tests.test_retriever_support import build_index, free_port, wait_healthy, write_jsonl

EOS = "<|im_end|>"
CODE_TURN = "Let me compute.\n```python\nprint(6 * 7)\n```\n```output"
ANSWER_TURN = "So the answer is \\boxed{42}." + EOS
SEARCH_TURN = "<search> capital of france </search>"
SEARCH_ANSWER = "<answer> Paris </answer>"
CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"Cheese"\nFrance makes many cheeses.'},
]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    from sandbox.testing import ServerProcess

    root = tmp_path_factory.mktemp("e2e")
    build_index(write_jsonl(root / "corpus.jsonl", CORPUS), root / "index", "bm25")
    port = free_port()
    retriever = subprocess.Popen([sys.executable, "-m", "retriever", "serve", "--index", str(root / "index"),
                                  "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=retriever)
        with ServerProcess() as sandbox:
            yield sandbox.url, f"http://127.0.0.1:{port}"
    finally:
        retriever.terminate()
        retriever.wait(timeout=30)


def teach(tokenizer, sequences: list[list[tuple[list[int], bool]]], max_steps: int = 400):
    """A tiny Qwen2 trained until greedy decoding reproduces the model's pieces of every sequence
    (teacher-forced argmax on them); a sequence is a list of (ids, the model writes them)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    batch = []
    for pieces in sequences:
        ids = torch.tensor([[t for piece, _ in pieces for t in piece]])
        labels = torch.tensor([[t if written else -100 for piece, written in pieces for t in piece]])
        batch.append((ids, labels))
    for _ in range(max_steps):
        loss = sum(model(input_ids=x, labels=y).loss for x, y in batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            predicted = [(model(input_ids=x).logits[0, :-1].argmax(-1), y[0, 1:]) for x, y in batch]
        if all(bool((p[y != -100] == y[y != -100]).all()) for p, y in predicted):
            return model.eval()
    raise AssertionError("the tiny model did not learn its transcripts")


def test_tiny_model_calls_the_real_sandbox_and_retriever(services, tiny_tokenizer):
    asyncio.run(_scenario(services, tiny_tokenizer))


async def _scenario(services, tok):
    sandbox_url, retriever_url = services
    code, search = CodeTool(sandbox_url), SearchTool(retriever_url, topk=2)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ran = await code.call(ToolCall("python", {"code": "print(6 * 7)\n"}))
    found = await search.call(ToolCall("search", {"query": "capital of france"}))
    assert ran.ok and ran.text == "42\n", ran
    assert found.ok and found.text.startswith('Doc 1(Title: "Paris") Paris is the capital of France.'), found
    torl, searchr1 = TorlFormat(), SearchR1Format()
    code_obs = torl.render([], [ran], CODE_TURN)
    search_obs = searchr1.render([], [found], SEARCH_TURN)
    assert code_obs == "\n42\n```\n"

    prompts = [Prompt("math", "Q1 Assistant:\n", tuple(enc("Q1 Assistant:\n")), "6 * 7?", "42"),
               Prompt("qa", "Q2 ", tuple(enc("Q2 ")), "capital of france?", ["Paris"])]
    model = teach(tok, [
        [(list(prompts[0].token_ids), False), (enc(CODE_TURN), True), (enc(code_obs), False), (enc(ANSWER_TURN), True)],
        [(list(prompts[1].token_ids), False), (enc(SEARCH_TURN), True), (enc(search_obs), False), (enc(SEARCH_ANSWER), True)],
    ])
    engine = HFEngine(model, tok)
    config = RolloutConfig(n=2, temperature=0.0)
    budgets = Budgets(max_turns=3, max_tool_calls=2, max_response_tokens=200)
    (math_group,), (qa_group,) = await asyncio.gather(
        rollout(prompts[:1], engine=engine, fmt=torl, tools={"python": code}, budgets=budgets, tokenizer=tok, config=config),
        rollout(prompts[1:], engine=engine, fmt=searchr1, tools={"search": search}, budgets=budgets, tokenizer=tok, config=config),
    )
    await code.aclose()
    await search.aclose()

    math_reward, qa_reward = build_reward("math", {}), build_reward("qa_em", {})
    for t in math_group.trajectories:
        assert t.stop_reason == StopReason.EOS
        assert [s.source for s in t.segments] == ["model", "tool", "model"]
        assert tok.decode(t.response_ids) == CODE_TURN + code_obs + ANSWER_TURN
        assert t.segments[1].token_ids == enc(code_obs) and t.tool_records[0].result.ok
        assert t.loss_mask == [1] * len(enc(CODE_TURN)) + [0] * len(enc(code_obs)) + [1] * len(enc(ANSWER_TURN))
        assert math_reward(tok.decode(t.response_ids), t.prompt.ground_truth).score == 1.0
    for t in qa_group.trajectories:
        assert t.stop_reason == StopReason.ANSWERED
        assert tok.decode(t.segments[1].token_ids) == search_obs
        assert tok.decode(t.segments[2].token_ids) == SEARCH_ANSWER
        assert qa_reward(tok.decode(t.response_ids), t.prompt.ground_truth).score == 1.0


def test_a_dead_service_is_an_observation_not_a_crash(tiny_tokenizer):
    """No sandbox listens on the port: the call fails fast as an observation and the trajectory goes on."""
    code = CodeTool(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff_s=0.01)
    result = asyncio.run(code.call(ToolCall("python", {"code": "print(1)"})))
    assert result.error == "connection" and result.text
