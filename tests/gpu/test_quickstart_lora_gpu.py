"""The code quickstart with LoRA on one GPU, through the commands a user runs: `agentrl sft` on CUDA, then
`agentrl train` with `model.lora` and vLLM colocated (serving base + adapter, each push checked), and
`agentrl eval --engine vllm` of the SFT checkpoint, of the run's merged export and of its adapter alone.
RL must raise the held-out tool-call rate and accuracy, and the merged export and the adapter (merged by
eval into the base it names) must score alike."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import REPO
from tests.gpu.test_quickstart_gpu import _cli

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def test_code_quickstart_learns_with_lora_on_vllm(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from agentrl.quickstart.__main__ import prepare_to

    monkeypatch.chdir(REPO)
    qs = prepare_to(tmp_path / "qs", search=False, progress=False)
    _cli("sft", "configs/quickstart_code_sft.yaml", "--set", f"data={qs}/code/traces.jsonl",
         "--set", f"model.tokenizer={qs}/tokenizer", "--set", f"trainer.run_dir={qs}/code_sft",
         "--set", "learner.device=cuda", "--set", "logging.progress=false")
    # LoRA at ten times the full run's learning rate (README: LoRA)
    _cli("train", "configs/quickstart_code.yaml", "--set", f"model.path={qs}/code_sft/export",
         "--set", f"task.dataset.path={qs}/code/train.jsonl", "--set", f"trainer.run_dir={qs}/lora_rl",
         "--set", "engine.kind=vllm", "--set", "learner.device=cuda", "--set", "logging.progress=false",
         "--set", "model.lora.rank=16", "--set", "model.lora.alpha=32", "--set", "learner.optim.lr=2e-3")
    metrics = [json.loads(line) for line in (qs / "lora_rl/metrics.jsonl").read_text().splitlines()]
    assert all(m["sync/probe_gap"] < 0.1 for m in metrics)  # every push took (the run would have failed)
    results = {}
    for name, model in (("sft", "code_sft/export"), ("merged", "lora_rl/export"), ("adapter", "lora_rl/export/adapter")):
        _cli("eval", "--engine", "vllm", "--benchmarks", "task", "--limit", "200", "--n", "4", "--temperature", "1",
             "--task", "tasks/quickstart_code.yaml", "--set", f"dataset.path={qs}/code/test.jsonl",
             "--model", f"{qs}/{model}", "--out", f"{qs}/eval_{name}")
        results[name] = json.loads((qs / f"eval_{name}/results.json").read_text())["results"]["task"]
    print({name: {k: r[k] for k in ("pass@1", "tool_call_rate", "turns")} for name, r in results.items()})
    before, after = results["sft"], results["merged"]
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.2
    assert after["pass@1"] > before["pass@1"] + 0.15
    assert abs(results["adapter"]["pass@1"] - after["pass@1"]) < 0.05  # 800 samples each: ~0.015 apart by chance
