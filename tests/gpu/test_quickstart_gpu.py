"""The code quickstart on one GPU, the way the README says to run it there: `agentrl sft` with the learner on
CUDA, `agentrl eval --engine vllm`, `agentrl train` with vLLM colocated (asleep while the learner trains),
the eval again. RL must raise the held-out tool-call rate and accuracy, as on the CPU."""

from __future__ import annotations

import json
import time

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")


def _cli(*args: str) -> float:
    from agentrl.cli import app

    start = time.perf_counter()
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)
    return time.perf_counter() - start


def test_code_quickstart_learns_on_a_gpu_with_vllm(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from agentrl.quickstart.__main__ import prepare_to

    monkeypatch.chdir(REPO)
    qs = prepare_to(tmp_path / "qs", search=False, progress=False)  # the search half needs bm25s
    wall = {"sft": _cli("sft", "configs/quickstart_code_sft.yaml", "--set", f"data={qs}/code/traces.jsonl",
                        "--set", f"model.tokenizer={qs}/tokenizer", "--set", f"trainer.run_dir={qs}/code_sft",
                        "--set", "learner.device=cuda", "--set", "logging.progress=false")}
    results = {}
    for run in ("code_sft", "code_rl"):
        if run == "code_rl":
            wall["train"] = _cli("train", "configs/quickstart_code.yaml", "--set", f"model.path={qs}/code_sft/export",
                                 "--set", f"task.dataset.path={qs}/code/train.jsonl", "--set", f"trainer.run_dir={qs}/code_rl",
                                 "--set", "engine.kind=vllm", "--set", "learner.device=cuda",
                                 "--set", "logging.progress=false")
        wall[f"eval {run}"] = _cli("eval", "--engine", "vllm", "--benchmarks", "task", "--limit", "200", "--n", "4",
                                   "--temperature", "1", "--task", "tasks/quickstart_code.yaml",
                                   "--set", f"dataset.path={qs}/code/test.jsonl", "--model", f"{qs}/{run}/export",
                                   "--out", f"{qs}/{run}/eval")
        results[run] = json.loads((qs / run / "eval/results.json").read_text())["results"]["task"]
    print({k: round(v, 1) for k, v in wall.items()})
    print({run: {k: r[k] for k in ("pass@1", "tool_call_rate", "turns")} for run, r in results.items()})
    before, after = results["code_sft"], results["code_rl"]
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.2
    assert after["pass@1"] > before["pass@1"] + 0.15
