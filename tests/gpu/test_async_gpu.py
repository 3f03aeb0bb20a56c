"""Asynchronous training on one GPU: vLLM stays awake and keeps generating while the FSDP2 learner trains on
the same device (a random-weight Qwen2.5-0.5B-shaped model, the real Qwen2.5 tokenizer, the ToRL task with
the real sandbox). Requests of `chunk_tokens` let each weight push (CUDA IPC) in at a token boundary, so
trajectories in flight continue under the new weights; after the last push the engine samples from the
learner's final weights. The engine runs in a child process (engine.own_process, the default), each push mapping the
learner's buckets there by CUDA IPC, or in the trainer's process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_trainer_gpu import _run_and_compare, gpu_run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


@pytest.mark.parametrize("own_process", [True, False], ids=["engine-own-process", "engine-in-process"])
def test_async_run_on_one_gpu_keeps_generating_across_weight_pushes(tmp_path, monkeypatch, own_process):
    pytest.importorskip("vllm")
    import asyncio

    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer

    monkeypatch.chdir(REPO)
    config = load_run_config(gpu_run_config(tmp_path, steps=3, prompts=8, n=4, samples_per_step=32),
                             ["algo.entropy_coef=0.01", "learner.optim.lr=1e-4", "trainer.mode=async",
                              "trainer.max_staleness=1", "trainer.chunk_tokens=32",
                              f"engine.own_process={str(own_process).lower()}"])
    gaps = asyncio.run(_run_and_compare(Trainer(config)))
    run = Path(config.run_dir)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert "timing/sleep" not in m  # the engine stays awake
        assert m["async/staleness_max"] <= 1 and m["actor/step_skipped"] == 0.0
    assert sum(m["async/partial_trajectories"] for m in metrics) > 0  # some spanned a push
    # a trajectory that spanned a push carries both versions, the older first, on its model segments
    spanning = 0
    for step in (2, 3):
        for line in (run / "samples" / f"step_{step}.jsonl").read_text().splitlines():
            versions = [s["version"] for s in json.loads(line)["segments"] if s["source"] == "model"]
            assert versions == sorted(versions) and max(versions) <= step - 1
            spanning += len(set(versions)) > 1
    assert spanning > 0
    engine_gap, stale_gap = gaps
    assert engine_gap < 0.05 and engine_gap < 0.5 * stale_gap, gaps
