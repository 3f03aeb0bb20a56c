"""The quickstart, shortened (two thirds of the code task's SFT steps, 14 RL steps of 20, fewer held-out
problems), through the commands `make demo` runs: SFT on mixed traces, a held-out eval, GRPO with the real
sandbox or retriever, the eval again. RL must raise the training reward, the held-out tool-call rate and
the held-out accuracy. The code task learns the same way from the same SFT start with LoRA adapters, and
when its interpreter is a user's function (examples/calculator.yaml) instead of the sandbox."""

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


def _sft(qs: Path, task: str, *sft: str) -> dict[str, float]:
    """SFT of the task's model under `<qs>/<task>_sft` (once per module), and its held-out eval."""
    if not (qs / f"{task}_sft/eval/results.json").exists():
        _cli("sft", str(ROOT / f"configs/quickstart_{task}_sft.yaml"), "--set", f"data={qs}/{task}/traces.jsonl",
             "--set", f"model.tokenizer={qs}/tokenizer", "--set", f"trainer.run_dir={qs}/{task}_sft",
             "--set", "logging.progress=false", *sft)
    return _eval(qs, task, f"{task}_sft", *_index(qs, task))


def _index(qs: Path, task: str) -> list[str]:
    return ["--index", str(qs / "search/index")] if task == "search" else []


def _learns(qs: Path, task: str, before: dict[str, float], rl_steps: int, *sets: str, run: str = "") -> None:
    run = run or f"{task}_rl"
    _cli("train", str(ROOT / f"configs/quickstart_{task}.yaml"), "--set", f"model.path={qs}/{task}_sft/export",
         "--set", f"trainer.run_dir={qs}/{run}", "--set", f"trainer.steps={rl_steps}",
         "--set", "logging.progress=false", *sets)
    after = _eval(qs, task, run, *_index(qs, task))
    rewards = [json.loads(line)["reward/mean"] for line in (qs / f"{run}/metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4, rewards
    assert after["tool_call_rate"] > before["tool_call_rate"] + 0.15, (before, after)
    assert after["pass@1"] > before["pass@1"] + 0.05, (before, after)


# two thirds of the quickstart's SFT (two passes over the traces, the cosine schedule ending with them)
CODE_SFT = ("--set", "trainer.epochs=2", "--set", "learner.optim.total_steps=1000")


def test_search_quickstart_learns_to_search(qs):
    before = _sft(qs, "search")
    _learns(qs, "search", before, 14, "--set", f"task.dataset.path={qs}/search/train.jsonl",
            "--set", f"services.retriever_index={qs}/search/index")
    table = table_text(qs)
    assert "| search | SFT |" in table and "| search | SFT + RL |" in table


def test_code_quickstart_learns_to_use_the_interpreter(qs):
    _learns(qs, "code", _sft(qs, "code", *CODE_SFT), 14, "--set", f"task.dataset.path={qs}/code/train.jsonl")


def test_code_quickstart_learns_with_lora(qs):
    """LoRA from the same SFT start: rank 16 on every Linear of the decoder, at ten times the full run's rate
    (LoRA Without Regret's advice); the export evaluated is the merged model."""
    _learns(qs, "code", _sft(qs, "code", *CODE_SFT), 14, "--set", f"task.dataset.path={qs}/code/train.jsonl",
            "--set", "model.lora.rank=16", "--set", "model.lora.alpha=32", "--set", "learner.optim.lr=2e-3",
            run="code_lora_rl")
    assert (qs / "code_lora_rl/export/adapter/adapter_config.json").exists()


def test_code_quickstart_learns_to_use_a_function_of_the_users_as_its_interpreter(qs):
    """examples/calculator.yaml: the same task, its `python` tool the user's calculator function (no sandbox
    runs), from the same SFT start; the eval (the task's own spec) calls the sandbox, the same program."""
    import yaml

    before = _sft(qs, "code", *CODE_SFT)
    spec = yaml.safe_load((ROOT / "examples/calculator.yaml").read_text())
    spec["dataset"]["path"] = str(qs / "code/train.jsonl")
    spec["tools"]["functions"][0]["function"] = str(ROOT / spec["tools"]["functions"][0]["function"])
    (qs / "calculator.yaml").write_text(yaml.safe_dump(spec))
    _learns(qs, "code", before, 14, "--set", f"task={qs}/calculator.yaml", run="calculator_rl")
    metrics = [json.loads(line) for line in (qs / "calculator_rl/metrics.jsonl").read_text().splitlines()]
    assert all(m.get("tool/errors/connection", 0) == 0 for m in metrics)  # no service: the function answered
    assert not (qs / "calculator_rl/logs/sandbox-0.log").exists()
