"""The examples/ directory: each example task runs as the README says."""

from __future__ import annotations

import asyncio

from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.task import load_task
from tests.conftest import REPO

UNITS = "examples/units.yaml"


def test_the_units_example_validates_and_its_reward_grades_the_references(monkeypatch):
    monkeypatch.chdir(REPO)
    valid = CliRunner().invoke(app, ["tasks", "validate", UNITS])
    assert valid.exit_code == 0 and "hermes ['convert'] (1 schemas)" in valid.output, valid.output
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
