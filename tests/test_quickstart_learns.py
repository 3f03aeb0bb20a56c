"""The quickstart, shortened (two thirds of the code task's SFT steps, 14 RL steps of 20, fewer held-out
problems), through the commands `make demo` runs: SFT on mixed traces, a held-out eval, GRPO with the real
sandbox or retriever, the eval again. RL must raise the training reward, the held-out tool-call rate and
the held-out accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.quickstart.__main__ import prepare_to, table_text

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def qs(tmp_path_factory) -> Path:
    return prepare_to(tmp_path_factory.mktemp("quickstart") / "qs", code_task=str(ROOT / "tasks/quickstart_code.yaml"),
                      search_task=str(ROOT / "tasks/quickstart_search.yaml"), progress=False)


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output + repr(result.exception)


def _eval(qs: Path, task: str, run: str, *extra: str) -> dict[str, float]:
    _cli("eval", "--benchmarks", "task", "--limit", "100", "--n", "2", "--temperature", "1",
         "--task", str(ROOT / f"tasks/quickstart_{task}.yaml"), "--set", f"dataset.path={qs}/{task}/test.jsonl",
         "--model", str(qs / run / "export"), "--out", str(qs / run / "eval"), *extra)
    return json.loads((qs / run / "eval/results.json").read_text())["results"]["task"]


def _learns(qs: Path, task: str, sft: list[str], rl_steps: int, services: list[str]) -> None:
    _cli("sft", str(ROOT / f"configs/quickstart_{task}_sft.yaml"), "--set", f"data={qs}/{task}/traces.jsonl",
         "--set", f"model.tokenizer={qs}/tokenizer", "--set", f"trainer.run_dir={qs}/{task}_sft",
         "--set", "logging.progress=false", *sft)
    extra = ["--index", str(qs / "search/index")] if task == "search" else []
    before = _eval(qs, task, f"{task}_sft", *extra)
    _cli("train", str(ROOT / f"configs/quickstart_{task}.yaml"), "--set", f"model.path={qs}/{task}_sft/export",
         "--set", f"task.dataset.path={qs}/{task}/train.jsonl", "--set", f"trainer.run_dir={qs}/{task}_rl",
         "--set", f"trainer.steps={rl_steps}", "--set", "logging.progress=false", *services)
    after = _eval(qs, task, f"{task}_rl", *extra)
    rewards = [json.loads(line)["reward/mean"] for line in (qs / f"{task}_rl/metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.15, (before, after)
    assert after["pass@1"] > before["pass@1"] + 0.05, (before, after)


def test_search_quickstart_learns_to_search(qs):
    _learns(qs, "search", sft=[], rl_steps=14, services=["--set", f"services.retriever_index={qs}/search/index"])
    table = table_text(qs)
    assert "| search | SFT |" in table and "| search | SFT + RL |" in table


def test_code_quickstart_learns_to_use_the_interpreter(qs):
    # two thirds of the quickstart's SFT (two passes over the traces, the cosine schedule ending with them)
    _learns(qs, "code", sft=["--set", "trainer.epochs=2", "--set", "learner.optim.total_steps=1000"], rl_steps=14,
            services=[])
