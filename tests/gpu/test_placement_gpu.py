"""The trainer on Ray on one GPU, against a cluster started as users start one (`ray start --head`): a
learner rank and a vLLM engine as actors, a random-weight Qwen2.5-0.5B-shaped model with the real Qwen2.5
tokenizer, the ToRL task with the real sandbox, in both placement modes:
- colocated: the engine shares the learner's GPU, sleeps while it trains, and takes the weights by CUDA IPC;
- split (with share_gpus, the one-GPU form): the engine stays awake and takes the weights by NCCL broadcast
  from the learner's process (two processes on one GPU, which NCCL sees as two hosts).
After the last push the engine samples from the learner's final weights (the export), not the initial ones.
With `+lora` the learner trains a LoRA adapter and each push carries the adapter alone (as bytes through the
host, in both modes) to vLLM, which serves base + adapter: the engine then samples from the merged export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, ray_token_mode
from tests.gpu.test_trainer_gpu import gpu_run_config, init_tensors

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)"),
              pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("vllm")
    ray_token_mode()
    ray = pytest.importorskip("ray")
    from agentrl.learner.fsdp import free_port

    command = [sys.executable, "-m", "ray.scripts.scripts"]  # Ray's CLI, wherever its package is
    port = free_port()
    subprocess.run([*command, "start", "--head", f"--port={port}", "--num-gpus=1", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, cwd=REPO)
    yield f"127.0.0.1:{port}"
    if ray.is_initialized():
        ray.shutdown()
    subprocess.run([*command, "stop", "--force"], check=False, capture_output=True)


@pytest.mark.parametrize("mode", ["colocated", "split", "colocated+lora", "split+lora"])
def test_a_ray_run_on_one_gpu_pushes_the_learner_weights_to_the_vllm_engine(cluster, tmp_path, monkeypatch, mode):
    import asyncio

    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer

    monkeypatch.chdir(REPO)
    mode, _, lora = mode.partition("+")
    sets = ["algo.entropy_coef=0.01", "learner.optim.lr=1e-4", f"placement.ray_address={cluster}",
            f"placement.mode={mode}", "engine.gpu_memory_utilization=0.3"]
    if mode == "split":
        sets.append("placement.share_gpus=true")
    if lora:
        pytest.importorskip("peft")
        sets += ["model.lora.rank=16", "model.lora.alpha=32", "learner.optim.lr=2e-3"]
    config = load_run_config(gpu_run_config(tmp_path, steps=3, prompts=8, n=4), sets)
    trainer = Trainer(config)
    gaps = asyncio.run(_run_and_compare(trainer))
    metrics = [json.loads(line) for line in (Path(config.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"timing/weight_sync", "timing/rollout", "timing/train"} <= set(m)
        assert ("timing/sleep" in m) == (mode == "colocated")
        assert m["actor/logprob_gap"] < 0.05, m["actor/logprob_gap"]
        assert m["sync/probe_gap"] < config.trainer.probe_tolerance
    engine_gap, stale_gap = gaps
    if lora:  # the adapter alone crossed (a small share of the weights' bytes); the engine serves the merged policy
        full_bytes = 2 * sum(t.numel() for t in init_tensors(Path(config.run_dir)))  # the bf16 weights
        assert all(0 < m["sync/bytes"] < 0.05 * full_bytes for m in metrics)
        assert engine_gap < 0.05, gaps
    else:
        assert engine_gap < 0.05 and engine_gap < 0.5 * stale_gap, gaps


async def _run_and_compare(trainer) -> tuple[float, float]:
    """The mean |logprob| gap of a fresh engine sample to the exported (final) policy, and of the initial
    weights to that policy."""
    from transformers import AutoModelForCausalLM

    from agentrl.engine import Sampling

    try:
        await trainer.run()
        prompt_ids = trainer.tokenizer.encode("What is 12 + 30? Let me think step by step.")
        c = await trainer.engine.generate(prompt_ids, Sampling(max_tokens=64, temperature=1.0))
    finally:
        await trainer.aclose()
    run = Path(trainer.config.run_dir)
    ids = torch.tensor([prompt_ids + c.token_ids], device="cuda")
    n = len(prompt_ids)

    def logprobs(path: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        return logp[n - 1 : -1].gather(1, ids[0, n:, None])[:, 0].cpu()

    final, init = logprobs(run / "export"), logprobs(run / "init")
    engine = torch.tensor(c.logprobs)
    return float((engine - final).abs().mean()), float((init - final).abs().mean())
