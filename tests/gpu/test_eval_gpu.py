"""`agentrl eval` on the GPU: vLLM (per-request seeds) through the training rollout loop with the real sandbox,
a random-weight Qwen2.5-0.5B-shaped checkpoint with the real tokenizer; a resumed run gives the same results."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_trainer_gpu import tokenizer_dir

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def test_eval_with_vllm_and_the_sandbox(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    from agentrl.engine.random_model import write_random_checkpoint
    from agentrl.engine.vllm import VLLMEngine
    from agentrl.eval.run import run_eval
    from agentrl.run_config import ServicesConfig
    from agentrl.services import Services
    from agentrl.task import load_task

    monkeypatch.chdir(REPO)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    model = write_random_checkpoint(tmp_path / "model", tok, shape="qwen2.5-0.5b", max_position_embeddings=4096)
    rows = [{"problem": f"What is {a} * {b}?", "answer": str(a * b), "unique_id": f"q{a}"} for a, b in
            [(12, 34), (56, 78), (91, 23), (45, 67)]]
    (tmp_path / "data" / "math").mkdir(parents=True)
    (tmp_path / "data" / "math" / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = load_task(REPO / "tasks" / "torl_math.yaml", ["budgets.max_response_tokens=128"]).spec

    async def run(out: str) -> dict:
        engine = VLLMEngine(str(model), seed=0, use_request_seeds=True, gpu_memory_utilization=0.3,
                            enforce_eager=True, max_model_len=4096)
        try:
            return await run_eval(spec=spec, benchmarks="math500", engine=engine, tokenizer=tok, out=tmp_path / out,
                                  n=4, temperature=1.0, data_dir=str(tmp_path / "data"), tool_urls=services.urls,
                                  progress=False)
        finally:
            await engine.aclose()

    with Services(["python"], ServicesConfig(), tmp_path / "logs") as services:
        first = asyncio.run(run("a"))["math500"]
        again = asyncio.run(run("a"))["math500"]  # everything is there: nothing runs, the same results
    assert first["prompts"] == 4 and first["samples"] == 16 and again == first
    records = [json.loads(line) for line in (tmp_path / "a" / "math500.samples.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(r["response_tokens"] > 0 for r in records)
