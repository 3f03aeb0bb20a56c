"""The examples/ directory: each example task runs as the README says."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.task import load_task
from tests.conftest import REPO

UNITS = "examples/units.yaml"


def test_the_units_example_validates_and_its_reward_grades_the_references(monkeypatch):
    monkeypatch.chdir(REPO)
    valid = CliRunner().invoke(app, ["tasks", "validate", UNITS])
    assert valid.exit_code == 0 and "hermes ['convert']" in valid.output, valid.output
    checked = CliRunner().invoke(app, ["tasks", "check", UNITS, "--field", "reference"])
    assert checked.exit_code == 0 and "│   24 │      24 │   1.0000 │" in checked.output, checked.output


def test_the_units_example_rolls_out_with_its_tool_and_is_scored_by_its_reward(monkeypatch, qwen_tokenizer):
    from agentrl.rewards import score, task_reward
    from agentrl.tools import build_tools
    from agentrl.tools.formats import HermesFormat
    from tests.test_rollout import EOS, do_rollout

    monkeypatch.chdir(REPO)
    task = load_task(UNITS)
    spec = task.spec
    prompt = task.render(task.rows()[3], qwen_tokenizer)
    assert '"name": "convert"' in prompt.text  # the schema, in the system prompt
    gold = float(prompt.ground_truth)
    question = prompt.question.split()  # "How many <to> are <value> <from>?"
    value, to_name, from_name = question[4], question[2], question[5].rstrip("?")
    units = {"metres": "m", "kilometres": "km", "miles": "mi", "feet": "ft"}
    call = (f'<tool_call>{{"name": "convert", "arguments": {{"value": {value}, "from_unit": "{units[from_name]}", '
            f'"to_unit": "{units[to_name]}"}}}}</tool_call>')
    scripts = {prompt.id: [call + EOS, '<tool_call>{"name": "convert", "arguments": {"value": 1, "from_unit": "yd", '
                                  '"to_unit": "m"}}</tool_call>' + EOS, f"It is {gold} {units[to_name]}." + EOS]}
    tools = build_tools({}, functions=spec.tools.functions, workers=1)
    reward = task_reward(spec.reward, workers=1)
    try:
        _, (t,) = do_rollout(qwen_tokenizer, HermesFormat(qwen_tokenizer, task.tool_schemas), scripts,
                             spec.budgets, tools, prompts=[prompt])
        asyncio.run(score([t], reward, qwen_tokenizer))
    finally:
        asyncio.run(tools["convert"].aclose())
        reward.close()
    first, second = t.tool_records
    assert float(first.result.text) == gold and first.result.error is None
    assert second.result.error == "tool_error" and "unknown unit 'yd'" in second.result.text
    assert t.reward.score == 1.0 and t.reward.parts == {"correct": 1.0, "used_tool": 1.0} and t.error is None


def _train_scripted(tmp_path, tok, task, turns: list[str]) -> list[dict]:
    """`agentrl train`'s loop on `task` for two steps: a scripted model writes `turns` (hermes), a real tiny
    model scores the scripted tokens, the learner steps. The metrics of each step."""
    import json

    import yaml

    from agentrl.run_config import load_run_config
    from agentrl.trainer import Trainer
    from tests.conftest import QWEN_DIR
    from tests.test_trainer import ScriptedEngine

    class HermesScript(ScriptedEngine):
        turn_marker = "<tool_response>"

    run = {"name": "scripted", "task": task,
           "model": {"tokenizer": str(QWEN_DIR), "config": {
               "model_type": "qwen2", "vocab_size": (len(tok) + 127) // 128 * 128, "hidden_size": 16,
               "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "max_position_embeddings": 2048, "tie_word_embeddings": True, "eos_token_id": tok.eos_token_id}},
           "engine": {"kind": "hf", "device": "cpu"}, "rollout": {"n": 2, "temperature": 1.0},
           "learner": {"device": "cpu", "token_budget": 4096},
           "trainer": {"steps": 2, "prompts_per_step": 2, "run_dir": str(tmp_path / "run"), "probe_tokens": 0,
                       "eval_every": 0, "export": False, "save_every": 0, "samples_per_step": 4},
           "logging": {"progress": False}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    trainer = Trainer(load_run_config(tmp_path / "run.yaml"), engine=HermesScript(tok, turns))
    asyncio.run(trainer.run())
    metrics = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all("actor/loss" in m for m in metrics)
    return metrics


ASYNC_UNITS = """
import asyncio

from agentrl.tools.functions import load_function

units = load_function("examples/tools/units.py:convert")


async def convert(value: float, from_unit: str, to_unit: str) -> float:
    \"\"\"Convert a length from one unit to another, awaiting as a client of a remote service would.\"\"\"
    await asyncio.sleep(0)
    return units(value, from_unit, to_unit)
"""


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["function", "async function", "mcp server"])
def test_the_units_example_trains_through_the_trainer(tmp_path, monkeypatch, qwen_tokenizer, tool):
    """The units task through `agentrl train`, its tool a sync function, an async one, or the MCP server's:
    the scripted model calls it, the reward function scores the answer."""
    import json

    monkeypatch.chdir(REPO)
    task = {"function": UNITS, "mcp server": "examples/units_mcp.yaml"}.get(tool)
    if tool == "async function":
        (tmp_path / "async_units.py").write_text(ASYNC_UNITS)
        task = {"base": UNITS, "tools": {"functions": [{"function": f"{tmp_path}/async_units.py:convert"}]}}
    call = '<tool_call>{"name": "convert", "arguments": {"value": 5, "from_unit": "km", "to_unit": "m"}}</tool_call>'
    eos = qwen_tokenizer.eos_token
    for m in _train_scripted(tmp_path, qwen_tokenizer, task, [call + eos, "It is 5000.0 m." + eos]):
        assert m["tool/calls_per_trajectory"] == 1.0 and m["tool/error_rate"] == 0.0
        assert m["reward/used_tool"] == 1.0 and m["rollout/errored"] == 0.0  # the answer fits one row only
    sample = json.loads((tmp_path / "run/samples/step_1.jsonl").read_text().splitlines()[0])
    assert [s["source"] for s in sample["segments"]] == ["model", "tool", "model"]
    assert "5000.0" in sample["segments"][1]["text"]


@pytest.mark.slow
def test_the_guess_environment_trains_through_the_trainer(tmp_path, monkeypatch, qwen_tokenizer):
    """One game per trajectory through `agentrl train`: every row's secret is 7, the scripted model guesses
    3, then 7; the environment ends each episode and its reward is the trajectory's."""
    import json

    monkeypatch.chdir(REPO)
    rows = [{"id": f"g{i}", "question": "A number from 1 to 10.", "low": 1, "high": 10, "secret": 7, "answer": "7"}
            for i in range(4)]
    (tmp_path / "games.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"base": "examples/guess.yaml", "dataset": {"path": str(tmp_path / "games.jsonl")}}
    eos = qwen_tokenizer.eos_token
    turns = [f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>{eos}' for n in (3, 7)]
    for m in _train_scripted(tmp_path, qwen_tokenizer, task, turns):
        assert m["rollout/stop/done"] == 1.0 and m["tool/calls_per_trajectory"] == 2.0
        assert m["reward/mean"] == 1.0 and m["reward/rewarded_steps"] == 1.0 and m["rollout/errored"] == 0.0
    sample = json.loads((tmp_path / "run/samples/step_1.jsonl").read_text().splitlines()[0])
    assert [s["source"] for s in sample["segments"]] == ["model", "tool", "model"]  # nothing after the end
    assert "higher than 3" in sample["segments"][1]["text"]


def test_the_mcp_example_serves_the_same_tool(monkeypatch):
    from agentrl.tools import build_tools
    from agentrl.types import ToolCall

    monkeypatch.chdir(REPO)
    valid = CliRunner().invoke(app, ["tasks", "validate", "examples/units_mcp.yaml"])
    assert valid.exit_code == 0 and "hermes ['convert']" in valid.output, valid.output
    spec = load_task("examples/units_mcp.yaml").spec
    tools = build_tools({}, mcp=spec.tools.mcp)

    async def go():
        try:
            return await tools["convert"].call(ToolCall("convert", {"value": 5, "from_unit": "km", "to_unit": "m"}))
        finally:
            await tools["convert"].aclose()

    result = asyncio.run(go())
    assert (result.text, result.error) == ("5000.0", None)


def test_the_herds_example_routes_each_call_to_its_service(tmp_path, monkeypatch, tiny_tokenizer):
    """The tags format over the real sandbox and retriever (loopback HTTP), on data the example writes: the
    search goes to the retriever, the code to the sandbox, and the answer built from both is graded right."""
    from agentrl.rewards import score, task_reward
    from agentrl.rollout import RolloutConfig, rollout
    from agentrl.run_config import ServicesConfig
    from agentrl.services import Services
    from agentrl.tools import build_tools
    from agentrl.tools.formats import build_format
    from agentrl.tools.functions import load_function

    monkeypatch.chdir(REPO)
    data = load_function("examples/herds.py:prepare")(tmp_path / "herds", people=60)
    task = load_task("examples/herds.yaml", [f"dataset.path={data}/train.jsonl"])
    spec, tok = task.spec, tiny_tokenizer
    row = task.rows()[0]
    name = row.question.split(" sells ")[0]
    price = int(row.question.split(" for ")[1].split()[0])
    size = next(int(line.split("herd of ")[1].split()[0]) for line in (data / "corpus.jsonl").read_text().splitlines()
                if line.startswith(f'{{"id": "{name}"'))
    prompt = task.render(row, tok)
    turns = [f"<search> {name} </search>", f"```python\nprint({size} * {price})\n```\n```output",
             f"<answer> {size * price} </answer>"]
    config = ServicesConfig(retriever_index=str(data / "index"), sandbox_args=["--workers", "1"])
    with Services(spec.tools.names, config, tmp_path / "logs") as services:
        tools = build_tools(services.urls, spec.tools.search_topk, services.sandbox_token)

        async def go():
            from tests.test_rollout import ScriptedEngine

            try:
                [group] = await rollout([prompt], engine=ScriptedEngine(tok, {prompt.id: turns}), tools=tools,
                                        fmt=build_format("tags", names=spec.tools.names), budgets=spec.budgets,
                                        tokenizer=tok, config=RolloutConfig(n=1))
                await score(group.trajectories, task_reward(spec.reward), tok)
                return group.trajectories[0]
            finally:
                for tool in tools.values():
                    await tool.aclose()

        t = asyncio.run(go())
    search, python = t.tool_records
    assert (search.call.name, python.call.name) == ("search", "python")
    assert f"{name} was born in" in search.result.text and f"herd of {size} goats" in search.result.text
    assert python.result.text.strip() == str(size * price) == row.ground_truth
    assert t.reward.score == 1.0 and t.error is None and [s.source for s in t.segments] == [
        "model", "tool", "model", "tool", "model"]
