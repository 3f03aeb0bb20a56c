"""`agentrl train` colocated on one GPU: vLLM (asleep while the learner trains) and the FSDP2 learner on the
same device, a random-weight Qwen2.5-0.5B-shaped model with the real Qwen2.5 tokenizer, the ToRL task with
the real sandbox; weights pushed over CUDA IPC after every step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import QWEN_DIR, REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def tokenizer_dir() -> Path:
    path = Path(os.environ.get("AGENTRL_TOKENIZER", QWEN_DIR))
    if not (path / "tokenizer_config.json").exists():
        pytest.skip(f"{path}: no Qwen2.5 tokenizer (set AGENTRL_TOKENIZER to one)")
    return path


def gpu_run_config(tmp_path: Path, steps: int, prompts: int, n: int, shape: str = "qwen2.5-0.5b",
                   response_tokens: int = 256, eager: bool = True, **trainer: object) -> Path:
    """A run config file: debug_cpu.yaml's task and schedule on the GPU with vLLM and a real-sized model."""
    from transformers import AutoTokenizer

    from agentrl.engine.random_model import SHAPES

    tok = AutoTokenizer.from_pretrained(tokenizer_dir())
    config = yaml.safe_load((REPO / "configs" / "debug_cpu.yaml").read_text())
    config["model"] = {"tokenizer": str(tokenizer_dir()), "config": {
        "model_type": "qwen2", "vocab_size": (len(tok) + 127) // 128 * 128, "max_position_embeddings": 4096,
        "rope_theta": 1_000_000.0, "eos_token_id": tok.eos_token_id, **SHAPES[shape]}}
    config["task"]["budgets"] = {"max_response_tokens": response_tokens, "max_prompt_tokens": 400}
    config["engine"] = {"kind": "vllm", "gpu_memory_utilization": 0.35, "max_model_len": 4096, "enforce_eager": eager}
    config["learner"] = {"device": "cuda", "token_budget": 8192, "optim": {"lr": 1e-5}}
    config["rollout"] = {"n": n, "temperature": 1.0}
    config["logging"] = {"progress": False}
    config["trainer"] |= {"steps": steps, "prompts_per_step": prompts, "run_dir": str(tmp_path / "run"),
                          "eval_every": 0, "save_every": 0, **trainer}
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def init_tensors(run: Path) -> list[torch.Tensor]:
    """The run's initial weights (its init/ checkpoint), every tensor."""
    from safetensors.torch import load_file

    return [t for f in sorted((run / "init").glob("*.safetensors")) for t in load_file(str(f)).values()]


def test_colocated_vllm_run_with_sleep_wake_and_ipc_weight_push(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    import asyncio

    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer

    monkeypatch.chdir(REPO)
    config = load_run_config(gpu_run_config(tmp_path, steps=3, prompts=8, n=4),
                             ["algo.entropy_coef=0.01", "learner.optim.lr=1e-4"])
    gaps = asyncio.run(_run_and_compare(Trainer(config)))
    run = Path(config.run_dir)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"timing/sleep", "timing/wake", "timing/weight_sync", "timing/rollout", "timing/train"} <= set(m)
        assert m["actor/logprob_gap"] < 0.05, m["actor/logprob_gap"]
        assert m["actor/step_skipped"] == 0.0
    assert list((run / "export").glob("*.safetensors"))
    # after the last push vLLM samples from the learner's weights (to bf16 kernels' differences), and those
    # weights moved: the initial ones are further from the learner's than the engine is
    engine_gap, stale_gap = gaps
    assert engine_gap < 0.05 and engine_gap < 0.5 * stale_gap, gaps


async def _run_and_compare(trainer) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    from agentrl.engine import Sampling
    from agentrl.learner.packing import pack
    from agentrl.types import Prompt, Segment, StopReason, Trajectory

    try:
        await trainer.run()
        prompt_ids = trainer.tokenizer.encode("What is 12 + 30? Let me think step by step.")
        c = await trainer.engine.generate(prompt_ids, Sampling(max_tokens=64, temperature=1.0))
        t = Trajectory(Prompt("p", "", tuple(prompt_ids), "", ""), [Segment("model", c.token_ids, c.logprobs)],
                       StopReason.EOS)
        [batch] = pack([t], 8192)
        learner = trainer.learner.policy.compute_logprobs(batch)[0]
        engine = torch.tensor(c.logprobs)
        init = AutoModelForCausalLM.from_pretrained(Path(trainer.config.run_dir) / "init", dtype=torch.bfloat16).cuda()
        ids = torch.tensor([prompt_ids + c.token_ids], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(init(input_ids=ids).logits[0].float(), -1)
        n = len(prompt_ids)
        stale = logp[n - 1 : -1].gather(1, ids[0, n:, None])[:, 0].cpu()
        gaps = float((engine - learner).abs().mean()), float((stale - learner).abs().mean())
    finally:
        await trainer.aclose()
    # the export is a checkpoint vLLM serves: greedy from it is greedy from the learner's final weights
    from agentrl.engine.vllm import VLLMEngine

    served = VLLMEngine(str(Path(trainer.config.run_dir) / "export"), gpu_memory_utilization=0.2, enforce_eager=True,
                        max_model_len=1024)
    try:
        c = await served.generate(prompt_ids, Sampling(max_tokens=16, temperature=0.0))
        assert len(c.token_ids) > 0
    finally:
        await served.aclose()
    return gaps
