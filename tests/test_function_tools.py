"""Python functions as tools (agentrl/tools/functions.py, function_pool.py): schemas from signatures and
docstrings, arguments validated, calls in worker processes, and every failure an observation."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from agentrl.tools.function_pool import FunctionPool
from agentrl.tools.functions import FunctionTool, function_schema, load_function
from agentrl.types import ToolCall

TOOLS = '''
import asyncio


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    The sum, exactly.

    Args:
        a: the first number,
            any integer
        b (int): the second number

    Returns:
        their sum
    """
    return a + b


async def shout(text: str) -> str:
    """Upper-case a text."""
    await asyncio.sleep(0)
    return text.upper()


def spin(x: int) -> str:
    while True:
        pass


def boom(x: int) -> str:
    raise ValueError("x must be positive")


def opaque(x: int):
    return object()


def die(x: int) -> str:
    import os
    os._exit(3)


def table(rows: int) -> dict:
    return {"rows": rows, "names": ["a", "b"]}


NOT_CALLABLE = 3
'''


@pytest.fixture
def tools_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "broken.py").write_text("def f(:\n")
    return "tools.py"


def test_the_schema_comes_from_the_signature_and_the_docstring(tools_file):
    schema = function_schema(load_function(f"{tools_file}:add"), "add")
    assert schema == {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a"],
        "properties": {"a": {"type": "integer", "description": "the first number, any integer"},
                       "b": {"type": "integer", "default": 2, "description": "the second number"}}}}}


def test_a_given_schema_must_name_the_functions_parameters(tools_file):
    add = load_function(f"{tools_file}:add")
    given = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}
    assert function_schema(add, "add", "Sum.", given)["function"]["parameters"] is given
    with pytest.raises(ValueError, match=r"properties are the function's parameters \['a', 'b'\]; got \['a', 'c'\]"):
        function_schema(add, "add", None, {"type": "object", "properties": {"a": {}, "c": {}}, "required": ["a"]})
    with pytest.raises(ValueError, match=r"parameters.required must be \['a'\]"):
        function_schema(add, "add", None, given | {"required": ["a", "b"]})


@pytest.mark.parametrize("ref, message", [
    ("tools.py", r"expected 'path/to/file.py:name' or 'package.module:name'"),
    ("missing.py:f", r"no file .*missing.py"),
    ("broken.py:f", r"importing broken.py failed: SyntaxError"),
    ("tools.py:nothing", r"tools.py has no 'nothing'"),
    ("tools.py:NOT_CALLABLE", r"NOT_CALLABLE is a int, not a function"),
    ("no_such_package.mod:f", r"importing no_such_package.mod failed: ModuleNotFoundError"),
])
def test_a_bad_reference_says_what_is_wrong(tools_file, ref, message):
    with pytest.raises(ValueError, match=message):
        load_function(ref)


def _tool(tools_file: str, name: str, pool: FunctionPool, timeout_s: float = 30.0) -> FunctionTool:
    ref = f"{tools_file}:{name}"
    return FunctionTool(name, ref, load_function(ref), pool, timeout_s)


def test_calls_run_in_workers_and_every_failure_is_an_observation(tools_file):
    pool = FunctionPool(workers=2)

    async def go():
        add, shout = _tool(tools_file, "add", pool), _tool(tools_file, "shout", pool)
        results = {
            "sum": await add.call(ToolCall("add", {"a": 3})),
            "coerced": await add.call(ToolCall("add", {"a": "4", "b": 1})),
            "async": await shout.call(ToolCall("shout", {"text": "hi"})),
            "json": await _tool(tools_file, "table", pool).call(ToolCall("table", {"rows": 2})),
            "wrong type": await add.call(ToolCall("add", {"a": "x"})),
            "missing": await add.call(ToolCall("add", {"b": 1})),
            "extra": await add.call(ToolCall("add", {"a": 1, "c": 1})),
            "raises": await _tool(tools_file, "boom", pool).call(ToolCall("boom", {"x": 1})),
            "opaque": await _tool(tools_file, "opaque", pool).call(ToolCall("opaque", {"x": 1})),
            "dies": await _tool(tools_file, "die", pool).call(ToolCall("die", {"x": 1})),
            "after death": await add.call(ToolCall("add", {"a": 1, "b": 1})),
        }
        return results

    try:
        r = asyncio.run(go())
    finally:
        pool.close()
    assert (r["sum"].text, r["sum"].error) == ("5", None)
    assert r["coerced"].text == "5" and r["async"].text == "HI"
    assert r["json"].text == '{"rows": 2, "names": ["a", "b"]}'
    assert r["wrong type"].error == "bad_arguments" and r["wrong type"].text.startswith("Error: bad arguments for add: a:")
    assert r["missing"].error == "bad_arguments" and "a: Field required" in r["missing"].text
    assert r["extra"].error == "bad_arguments" and "c: Extra inputs are not permitted" in r["extra"].text
    assert r["raises"].text == "Error: ValueError: x must be positive"
    assert r["raises"].error == "tool_error" and not r["raises"].service_fault  # the model's call failed
    assert r["opaque"].error == "bad_response" and r["opaque"].service_fault  # the tool's own fault
    assert r["dies"].error == "exception" and "exit code 3" in r["dies"].text and r["dies"].service_fault
    assert r["after death"].text == "2" and pool.restarts == 1


def test_a_call_past_its_timeout_is_ended_with_its_worker(tools_file):
    pool = FunctionPool(workers=1)

    async def go():
        spin = _tool(tools_file, "spin", pool, timeout_s=0.5)
        stuck = await spin.call(ToolCall("spin", {"x": 1}))
        after = await _tool(tools_file, "add", pool).call(ToolCall("add", {"a": 2}))
        return stuck, after

    try:
        stuck, after = asyncio.run(go())
    finally:
        pool.close()
    assert stuck.error == "timeout" and "0.5 s" in stuck.text and not stuck.service_fault
    assert after.text == "4" and pool.restarts == 1


def test_docstring_args_sections_in_google_style(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "doc.py").write_text(textwrap.dedent('''
        def find(query: str, limit: int = 3, exact: bool = False) -> list:
            """Find rows.

            Args:
                query: what to look for
                limit: at most this many
                    rows
            """
            return []
    '''))
    props = function_schema(load_function("doc.py:find"), "find")["function"]["parameters"]["properties"]
    assert {k: v.get("description") for k, v in props.items()} == {
        "query": "what to look for", "limit": "at most this many rows", "exact": None}


def test_a_hermes_rollout_routes_each_call_to_its_function(tools_file, qwen_tokenizer):
    from agentrl.task_spec import Budgets, ToolsSpec
    from agentrl.tools import build_tools, tool_schemas
    from agentrl.tools.formats import HermesFormat
    from tests.test_rollout import EOS, do_rollout

    spec = ToolsSpec(format="hermes", functions=[{"function": f"{tools_file}:add"},
                                                 {"function": f"{tools_file}:shout", "name": "loud"}])
    schemas = tool_schemas(spec)
    assert [s["function"]["name"] for s in schemas] == ["add", "loud"]
    tools = build_tools({}, functions=spec.functions, workers=1)
    scripts = {"p0": ['<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>' + EOS,
                      '<tool_call>{"name": "loud", "arguments": {"text": "ok"}}</tool_call>' + EOS,
                      '<tool_call>{"name": "add", "arguments": {"a": "many"}}</tool_call>' + EOS,
                      "The answer is \\boxed{42}." + EOS]}
    try:
        _, (t,) = do_rollout(qwen_tokenizer, HermesFormat(qwen_tokenizer, schemas), scripts,
                             Budgets(max_turns=4, max_tool_calls=3, max_response_tokens=2048), tools)
    finally:
        asyncio.run(tools["add"].aclose())
    assert [(r.call.name, r.result.text, r.result.error) for r in t.tool_records][:2] == [("add", "42", None),
                                                                                       ("loud", "OK", None)]
    assert t.tool_records[2].result.error == "bad_arguments" and t.error is None  # the model's mistake: trained on
    observations = [qwen_tokenizer.decode(s.token_ids) for s in t.segments if s.source == "tool"]
    assert "42" in observations[0] and "OK" in observations[1] and "bad arguments for add" in observations[2]
    assert [s.source for s in t.segments] == ["model", "tool"] * 3 + ["model"]
    from agentrl.rollout import rollout_metrics

    m = rollout_metrics([t])  # the failure counted by its kind
    assert m["tool/error_rate"] == 1 / 3 and m["tool/errors/bad_arguments"] == 1 / 3


def _spec(tmp_path, functions: str) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "What is 40 + 2?", "answer": "42"}\n')
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: adder\ndataset: {{path: {data}}}\nprompt: {{messages: [{{role: user, content: '{{question}}'}}]}}\n"
                    f"tools: {{format: hermes, functions: {functions}}}\nreward: {{name: math}}\n"
                    "budgets: {max_turns: 3, max_tool_calls: 2}\n")
    return str(spec)


def test_tasks_validate_imports_the_functions_and_names_the_key(tools_file, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    good = CliRunner().invoke(app, ["tasks", "validate", _spec(tmp_path, f"[{{function: '{tools_file}:add'}}]")])
    assert good.exit_code == 0 and "hermes ['add']" in good.output
    for functions, message in [
        ("[{function: 'tools.py:nothing'}]", "tools.functions[0].function: 'tools.py:nothing': tools.py has no 'nothing'"),
        ("[{function: 'tools.py:add', parameters: {type: object, properties: {x: {}}}}]",
         "tools.functions[0]: tool 'add': parameters must be a JSON schema"),
        ("[{function: 'tools.py:add'}, {function: 'tools.py:add'}]", "two tools are named 'add'"),
        ("[{function: tools.py}]", "expected 'path/to/file.py:name'"),
    ]:
        bad = CliRunner().invoke(app, ["tasks", "validate", _spec(tmp_path, functions)])
        assert bad.exit_code == 1 and message in bad.output, bad.output


def test_a_function_stands_in_for_a_tag_formats_tool_only_with_its_argument(tools_file):
    from agentrl.config import ConfigError
    from agentrl.task_spec import ToolsSpec
    from agentrl.tools import tool_schemas

    spec = ToolsSpec(format="torl", functions=[{"function": f"{tools_file}:shout", "name": "python"}])
    with pytest.raises(ConfigError, match=r"tools.functions\[0\]: the torl format calls python with one argument "
                                          r"'code'; the function takes \['text'\]"):
        tool_schemas(spec)
    with pytest.raises(ValueError, match=r"drives exactly the tool \[python\], in names or as a function"):
        ToolsSpec(format="torl", functions=[{"function": f"{tools_file}:shout"}])


def test_tasks_show_prints_the_schemas_the_model_sees(tools_file, tmp_path, qwen_tokenizer):
    from typer.testing import CliRunner

    from agentrl.cli import app
    from tests.conftest import QWEN_DIR

    spec = _spec(tmp_path, f"[{{function: '{tools_file}:add', description: Adds.}}]")
    shown = CliRunner().invoke(app, ["tasks", "show", spec, "-n", "1", "--tokenizer", str(QWEN_DIR)])
    assert shown.exit_code == 0, shown.output
    assert '──── tool add ────\n{\n  "type": "function"' in shown.output and '"description": "Adds."' in shown.output
    assert '"name": "add", "description": "Adds."' in shown.output  # and the prompt holds it, as the template wrote it


REWARDS = '''
import time


def exact(response, ground_truth, tool_calls, bonus=0.0):
    correct = ground_truth in response
    used = any(c["name"] == "add" and c["error"] is None for c in tool_calls)
    return {"score": float(correct) + (bonus if used else 0.0), "correct": float(correct), "used_add": float(used)}


def plain(response, ground_truth, tool_calls):
    return 0.5


def raises(response, ground_truth, tool_calls):
    raise KeyError("no such answer")


def no_score(response, ground_truth, tool_calls):
    return {"correct": 1.0}


def slow(response, ground_truth, tool_calls):
    time.sleep(60)
'''


def test_a_reward_function_scores_from_the_models_text_and_errors_what_fails(tmp_path, monkeypatch, tiny_tokenizer):
    from agentrl.rewards import score, task_reward
    from agentrl.task_spec import RewardSpec
    from agentrl.types import Prompt, Segment, StopReason, ToolRecord, ToolResult, Trajectory

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(REWARDS)
    ids = tuple(tiny_tokenizer.encode("the answer is 42"))
    shown = tuple(tiny_tokenizer.encode(" 42 "))  # a tool printed it: never read by the reward

    def trajectory(answer_ids) -> Trajectory:
        prompt = Prompt(id="p", text="q", token_ids=(1,), question="q", ground_truth="42")
        segments = [Segment("tool", list(shown)), Segment("model", list(answer_ids), [0.0] * len(answer_ids))]
        records = [ToolRecord(1, ToolCall("add", {"a": 1}), ToolResult("42"))]
        return Trajectory(prompt, segments, StopReason.EOS, 0, records)

    results = {}
    for name, params in [("exact", {"bonus": 0.5}), ("plain", {}), ("raises", {}), ("no_score", {}), ("slow", {})]:
        reward = task_reward(RewardSpec(function=f"rewards.py:{name}", params=params, timeout_s=1), workers=1)
        ts = [trajectory(ids), trajectory(tuple(tiny_tokenizer.encode("no idea")))]
        try:
            asyncio.run(score(ts, reward, tiny_tokenizer))
        finally:
            reward.close()
        results[name] = [(t.reward.score, t.reward.parts, t.error) for t in ts]
    assert results["exact"] == [(1.5, {"correct": 1.0, "used_add": 1.0}, None),
                                (0.5, {"correct": 0.0, "used_add": 1.0}, None)]  # the tool's "42" earned nothing
    assert results["plain"] == [(0.5, {}, None)] * 2
    for failed in ("raises", "no_score", "slow"):  # out of the loss and counted; the run goes on
        assert results[failed] == [(0.0, {}, "reward")] * 2, failed
