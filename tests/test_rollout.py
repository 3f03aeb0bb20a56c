"""rollout.py with the tool formats: exact token ids, loss masks, stop reasons, budgets, tool failures,
void turns.

A scripted engine plays the model: it tokenizes the scripted text of each turn and stops like a real
engine (the token completing a stop string is returned whole, EOS is appended, max_tokens cuts), so the
ids of every model segment are known and must come back byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest

from agentrl.engine import Completion, Sampling, stop_completed_in_last_token
from agentrl.rollout import RolloutConfig, TrajectoryBuilder, rollout, rollout_metrics
from agentrl.samples import dump_trajectories
from agentrl.task_spec import Budgets
from agentrl.tools.formats import (
    SEARCH_R1_INVALID,
    HermesFormat,
    SearchR1Format,
    TagsFormat,
    TorlFormat,
    last_python_block,
)
from agentrl.types import Prompt, StopReason, ToolCall, ToolResult

EOS = "<|im_end|>"


class ScriptedEngine:
    """Turn k of trajectory `prompt_id/sample` produces `scripts[prompt_id][k]`, tokenized; a script ending
    in EOS emits the EOS token. Records every completion it returned."""

    def __init__(self, tokenizer, scripts: dict[str, list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.turns: dict[str, int] = defaultdict(int)
        self.returned: dict[str, list[list[int]]] = defaultdict(list)
        self.prompts_seen: dict[str, list[list[int]]] = defaultdict(list)

    async def generate(self, prompt_ids, sampling: Sampling, *, session=None) -> Completion:
        await asyncio.sleep(0)  # yield like a real engine would
        prompt_id = session.split("/")[0]
        text = self.scripts[prompt_id][self.turns[session]]
        self.turns[session] += 1
        self.prompts_seen[session].append(list(prompt_ids))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        out, finish, stop = [], "length", None
        for i, token in enumerate(ids):
            out.append(token)
            if token == self.tokenizer.eos_token_id:
                finish = "stop"
                break
            stop = stop_completed_in_last_token(self.tokenizer.decode(out), self.tokenizer.decode(out[:-1]), sampling.stop)
            if stop is not None:
                finish = "stop"
                break
            if len(out) >= sampling.max_tokens:
                break
            if i == len(ids) - 1:
                finish = "stop"  # the script ran out: as if EOS without the token
        logprobs = [-0.01 * (n + 1) for n in range(len(out))]
        self.returned[session].append(out)
        return Completion(out, logprobs, finish, stop)

    async def update_weights(self, named_tensors):
        raise AssertionError("not used")

    async def aclose(self):
        pass


class FunctionTool:
    """An in-process tool: `fn(arguments) -> ToolResult`; async sleeps simulate a slow service."""

    def __init__(self, name, fn, delay_s=0.0):
        self.name, self.fn, self.delay_s, self.calls = name, fn, delay_s, []

    async def call(self, call: ToolCall) -> ToolResult:
        self.calls.append(call)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.fn(call.arguments)

    async def aclose(self):
        pass


def run_python(arguments):
    code = arguments["code"]
    if "raise" in code:
        return ToolResult("Traceback (most recent call last):\n  File \"<string>\", line 1\nValueError: bad", error="execution_error")
    return ToolResult(str(eval(code.strip().removeprefix("print(").removesuffix(")"))) + "\n")


def prompt_of(tokenizer, text="Q", pid="p0", answer="5"):
    return Prompt(pid, text, tuple(tokenizer.encode(text, add_special_tokens=False)), text, answer)


def run(groups_coro):
    return asyncio.run(groups_coro)


def do_rollout(tokenizer, fmt, scripts, budgets, tools, n=1, mode="async", prompts=None):
    engine = ScriptedEngine(tokenizer, scripts)
    prompts = prompts or [prompt_of(tokenizer, pid=pid) for pid in scripts]
    groups = run(rollout(prompts, engine=engine, fmt=fmt, tools=tools, budgets=budgets, tokenizer=tokenizer,
                         config=RolloutConfig(n=n, mode=mode)))
    return engine, [t for g in groups for t in g.trajectories]


TORL_BUDGETS = Budgets(max_turns=3, max_tool_calls=2, max_response_tokens=400)


# --- ToRL -----------------------------------------------------------------------------------------------


@pytest.fixture
def tok(tiny_tokenizer):
    return tiny_tokenizer


def test_torl_segments_are_exactly_the_sampled_ids(tok):
    turn1 = "Compute it.\n```python\nprint(2 + 3)\n```\n```output"
    scripts = {"p0": [turn1 + "\nNEVER SEEN", "So the answer is \\boxed{5}." + EOS]}
    tool = FunctionTool("python", run_python)
    engine, (t,) = do_rollout(tok, TorlFormat(), scripts, TORL_BUDGETS, {"python": tool})
    returned = engine.returned["p0/0"]
    assert [s.source for s in t.segments] == ["model", "tool", "model"]
    assert t.segments[0].token_ids == returned[0] and t.segments[2].token_ids == returned[1]
    assert tok.decode(t.segments[0].token_ids).endswith("```output")  # the stop string stays in the ids
    assert tok.decode(t.segments[1].token_ids) == "\n5\n```\n"
    assert t.segments[1].token_ids == tok.encode("\n5\n```\n", add_special_tokens=False)
    assert t.loss_mask == [1] * len(returned[0]) + [0] * len(t.segments[1].token_ids) + [1] * len(returned[1])
    assert t.response_logprobs[: len(returned[0])] == [-0.01 * (i + 1) for i in range(len(returned[0]))]
    assert all(lp == 0.0 for lp in t.response_logprobs[len(returned[0]) : len(returned[0]) + len(t.segments[1].token_ids)])
    assert tool.calls[0].arguments == {"code": "print(2 + 3)\n"}
    assert t.stop_reason == StopReason.EOS and tok.decode(t.segments[2].token_ids).endswith(EOS)
    # The second turn continued from exactly prompt + turn 1 + observation.
    assert engine.prompts_seen["p0/0"][1] == list(t.prompt.token_ids) + returned[0] + t.segments[1].token_ids


def test_torl_error_keeps_last_line_and_long_output_is_cut(tok):
    fmt = TorlFormat(observation_max_chars=256)
    err = ToolResult("out\nTraceback (most recent call last):\n  File x\nZeroDivisionError: division by zero\n", error="execution_error")
    assert fmt.render([], [err], "```output") == "\nZeroDivisionError: division by zero\n```\n"
    long = ToolResult("a" * 100 + "b" * 100 + "c" * 100)
    body = fmt.render([], [long], "```output\n").removesuffix("\n```\n")
    assert body == "a" * 100 + "b" * 28 + "..." + "b" * 28 + "c" * 100  # first 128 + ... + last 128
    assert fmt.render([], [ToolResult("x" * 256)], "```output\n") == "x" * 256 + "\n```\n"  # cut only past 256


def test_torl_stop_token_carrying_the_newline_gets_no_second_one(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_tokens(["output\n"])  # the stop string ends inside a token that also holds the newline
    turn1 = "```python\nprint(5)\n```\n```output\n"
    assert tok.convert_ids_to_tokens(tok.encode(turn1, add_special_tokens=False))[-1] == "output\n"
    scripts = {"p0": [turn1, "\\boxed{5}" + EOS]}
    _, (t,) = do_rollout(tok, TorlFormat(), scripts, TORL_BUDGETS, {"python": FunctionTool("python", run_python)})
    assert tok.decode(t.segments[0].token_ids).endswith("```output\n")
    assert tok.decode(t.segments[1].token_ids) == "5\n```\n"  # not "\n5\n```\n": one newline in all


def test_torl_last_python_block_rules():
    text = "```python\na = 1\n```\nthen\n```python\nb = 2\nprint(b)\n```\n"
    assert last_python_block(text) == "b = 2\nprint(b)\n"
    assert last_python_block("```python\nunfinished = 1\n") is None
    assert last_python_block("no code") is None


def test_torl_malformed_call_is_an_observation(tok):
    scripts = {"p0": ["no code here\n```output", "\\boxed{5}" + EOS]}
    tool = FunctionTool("python", run_python)
    _, (t,) = do_rollout(tok, TorlFormat(), scripts, TORL_BUDGETS, {"python": tool})
    assert tool.calls == [] and t.timings["invalid_turns"] == 1
    assert "no complete ```python block" in tok.decode(t.segments[1].token_ids)
    # One parse-error policy: the invalid turn is a failed call of kind malformed, with no call parsed.
    assert [(r.call, r.result.error) for r in t.tool_records] == [(None, "malformed")]
    assert t.stop_reason == StopReason.EOS and t.loss_mask.count(0) == len(t.segments[1].token_ids)


# --- Search-R1 ------------------------------------------------------------------------------------------


def search_tool():
    return FunctionTool("search", lambda a: ToolResult(f'Doc 1(Title: "Paris") {a["query"]} is Paris.\n'))


def test_search_r1_search_then_answer(tok):
    scripts = {"p0": ["<think>look up</think><search> capital of France </search> junk",
                      "<answer> Paris </answer> trailing"]}
    tool = search_tool()
    engine, (t,) = do_rollout(tok, SearchR1Format(), scripts, Budgets(max_turns=3, max_tool_calls=2), {"search": tool})
    assert tool.calls[0].arguments == {"query": "capital of France"}
    assert tok.decode(t.segments[1].token_ids) == '\n\n<information>Doc 1(Title: "Paris") capital of France is Paris.</information>\n\n'
    assert t.stop_reason == StopReason.ANSWERED
    assert tok.decode(t.segments[2].token_ids).endswith("</answer>")  # stopped at the stop string
    assert [s.token_ids for s in t.segments if s.source == "model"] == engine.returned["p0/0"]


def test_search_r1_invalid_action_then_continue(tok):
    """A turn stopped by a stop string whose action does not parse gets Search-R1's invalid-action message."""
    scripts = {"p0": ["I just talk.</search>", "<answer>Paris</answer>"]}
    _, (t,) = do_rollout(tok, SearchR1Format(), scripts, Budgets(max_turns=3, max_tool_calls=2), {"search": search_tool()})
    assert tok.decode(t.segments[1].token_ids) == SEARCH_R1_INVALID
    assert t.stop_reason == StopReason.ANSWERED and t.timings["invalid_turns"] == 1
    assert [(r.call, r.result.error) for r in t.tool_records] == [(None, "malformed")]


@pytest.mark.parametrize("ending", [EOS, ""])  # "": the engine stopped without emitting the EOS token
def test_search_r1_turn_ending_without_an_action_ends_the_trajectory(tok, ending):
    """Nothing is appended after the model's EOS: the trajectory ends there, as it does in the other formats."""
    scripts = {"p0": ["I just talk." + ending, "<answer>Paris</answer>"]}
    engine, (t,) = do_rollout(tok, SearchR1Format(), scripts, Budgets(max_turns=3, max_tool_calls=2),
                              {"search": search_tool()})
    assert t.stop_reason == StopReason.EOS
    assert [s.source for s in t.segments] == ["model"] and t.segments[0].token_ids == engine.returned["p0/0"][0]
    assert tok.decode(t.response_ids) == "I just talk." + ending
    assert len(engine.returned["p0/0"]) == 1 and t.timings["invalid_turns"] == 0


def test_stop_string_ending_inside_a_token_keeps_the_whole_token(qwen_tokenizer):
    """With Qwen's tokenizer '>\\n\\n' is one token: '</search>' ends inside it. The id is kept whole and
    the query still parses from the decoded ids."""
    tok = qwen_tokenizer
    text = "<search> capital of France</search>\n\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[-1:]).startswith(">") and len(tok.decode(ids[-1:])) > 1
    scripts = {"p0": [text + "more", "<answer> Paris</answer>"]}
    tool = search_tool()
    engine, (t,) = do_rollout(tok, SearchR1Format(), scripts, Budgets(max_turns=3, max_tool_calls=2), {"search": tool})
    assert t.segments[0].token_ids == ids  # the whole last token, nothing after it
    assert tool.calls[0].arguments == {"query": "capital of France"}
    assert t.stop_reason == StopReason.ANSWERED
    # the newlines that token carried count toward Search-R1's "</search>\n\n<information>": none doubled
    assert "</search>\n\n<information>" in tok.decode(t.response_ids)


# --- ToRL and Search-R1 together (tags) ------------------------------------------------------------------


def test_tags_routes_each_call_to_its_tool_and_renders_it_in_its_own_syntax(tok):
    scripts = {"p0": ["<search> herd of Ana </search>", "```python\nprint(2 + 3)\n```\n```output",
                      "<answer> 5 </answer> never seen"]}
    python, search = FunctionTool("python", run_python), search_tool()
    budgets = Budgets(max_turns=4, max_tool_calls=3, max_response_tokens=400)
    _, (t,) = do_rollout(tok, TagsFormat(["python", "search"]), scripts, budgets, {"python": python, "search": search})
    assert [c.arguments for c in search.calls] == [{"query": "herd of Ana"}]
    assert [c.arguments for c in python.calls] == [{"code": "print(2 + 3)\n"}]
    assert [r.call.name for r in t.tool_records] == ["search", "python"]
    assert tok.decode(t.segments[1].token_ids).startswith("\n\n<information>Doc 1")  # Search-R1's observation
    assert tok.decode(t.segments[3].token_ids) == "\n5\n```\n"  # ToRL's
    assert t.stop_reason == StopReason.ANSWERED and tok.decode(t.segments[4].token_ids).endswith("</answer>")


def test_tags_parse_errors_follow_the_one_policy(tok):
    fmt = TagsFormat(["python", "search"])
    assert fmt.stop == ("```output", "</search>", "</answer>")
    scripts = {"p0": ["no code\n```output", "talk</search>", "<answer>5</answer>"]}
    budgets = Budgets(max_turns=4, max_tool_calls=3, max_response_tokens=400)
    _, (t,) = do_rollout(tok, fmt, scripts, budgets, {"python": FunctionTool("python", run_python),
                                                      "search": search_tool()})
    assert "no complete ```python block" in tok.decode(t.segments[1].token_ids)
    assert tok.decode(t.segments[3].token_ids) == SEARCH_R1_INVALID
    assert [(r.call, r.result.error) for r in t.tool_records] == [(None, "malformed"), (None, "malformed")]
    assert t.timings["invalid_turns"] == 2 and t.stop_reason == StopReason.ANSWERED
    assert TagsFormat(["python"]).stop == ("```output",)  # python alone: the answer is a \boxed{} at EOS


def test_a_tool_past_its_own_budget_is_answered_without_running(tok):
    scripts = {"p0": ["```python\nprint(1)\n```\n```output", "```python\nprint(2)\n```\n```output",
                      "<search> x </search>", "<answer> 1 </answer>"]}
    python, search = FunctionTool("python", run_python), search_tool()
    budgets = Budgets(max_turns=5, max_tool_calls=4, max_response_tokens=500, max_calls_per_tool={"python": 1})
    _, (t,) = do_rollout(tok, TagsFormat(["python", "search"]), scripts, budgets, {"python": python, "search": search})
    assert len(python.calls) == 1 and len(search.calls) == 1  # the second python call never ran
    assert [r.result.error for r in t.tool_records] == [None, "budget", None]
    assert "at most 1 calls" in tok.decode(t.segments[3].token_ids) and t.stop_reason == StopReason.ANSWERED
    assert rollout_metrics([t])["tool/errors/budget"] == pytest.approx(1 / 3)


# --- Hermes ---------------------------------------------------------------------------------------------


def test_hermes_incremental_ids_equal_a_full_rerender(qwen_tokenizer):
    tok = qwen_tokenizer
    from agentrl.tools import TOOL_SCHEMAS

    schemas = [TOOL_SCHEMAS["python"]]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    prompt_text = tok.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    # The template's own serialisation of the call: a model that writes it exactly gets equal ids.
    call = {"name": "python", "arguments": {"code": "print(2+3)"}}
    assistant = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    with_call = tok.apply_chat_template(messages + [assistant], tools=schemas, tokenize=False)
    model_text = with_call[len(prompt_text):].rstrip("\n")  # up to and including <|im_end|>
    assert model_text.endswith(EOS)
    prompt = Prompt("p0", prompt_text, tuple(tok.encode(prompt_text, add_special_tokens=False)), "What is 2+3?", "5")
    fmt = HermesFormat(tok, schemas)
    scripts = {"p0": [model_text, "It is 5." + EOS]}
    tool = FunctionTool("python", lambda a: ToolResult("5\n"))
    _, (t,) = do_rollout(tok, fmt, scripts, Budgets(max_turns=3, max_tool_calls=2), {"python": tool}, prompts=[prompt])
    assert tool.calls[0].arguments == {"code": "print(2+3)"}
    full = tok.apply_chat_template(
        messages + [assistant, {"role": "tool", "content": "5\n"}, {"role": "assistant", "content": "It is 5."}],
        tools=schemas, tokenize=False,
    ).rstrip("\n")
    incremental = list(prompt.token_ids) + t.response_ids
    assert incremental == tok.encode(full, add_special_tokens=False)
    assert tok.decode(t.segments[1].token_ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_hermes_malformed_and_unknown_tool_are_observations(qwen_tokenizer):
    tok = qwen_tokenizer
    fmt = HermesFormat(tok)
    scripts = {"p0": ['<tool_call>{"name": "python", "arguments": {oops}</tool_call>' + EOS,
                      '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>' + EOS, "done" + EOS]}
    _, (t,) = do_rollout(tok, fmt, scripts, Budgets(max_turns=3, max_tool_calls=2), {"python": FunctionTool("python", run_python)})
    assert "not valid JSON" in tok.decode(t.segments[1].token_ids)
    assert "there is no tool 'calculator'" in tok.decode(t.segments[3].token_ids)
    malformed, unknown = t.tool_records  # the unparsable call is a record too (a failed call), with no call
    assert malformed.call is None and malformed.result.error == "malformed"
    assert unknown.call.name == "calculator" and unknown.result.error == "unknown_tool"
    assert t.stop_reason == StopReason.EOS
    m = rollout_metrics([t])
    assert m["tool/calls_per_trajectory"] == 2.0 and m["tool/error_rate"] == 1.0


def test_hermes_deeply_nested_call_is_malformed_not_fatal(qwen_tokenizer):
    """json.loads raises RecursionError (not ValueError) on deep nesting, which a degenerate policy writes."""
    tok = qwen_tokenizer
    scripts = {"p0": ['<tool_call>{"name": "python", "arguments": ' + "[" * 3000 + "</tool_call>" + EOS, "done" + EOS]}
    _, (t,) = do_rollout(tok, HermesFormat(tok), scripts, Budgets(max_turns=3, max_tool_calls=2, max_response_tokens=4096),
                         {"python": FunctionTool("python", run_python)})
    assert "not valid JSON" in tok.decode(t.segments[1].token_ids) and t.stop_reason == StopReason.EOS


def test_hermes_long_tool_output_is_cut_inside_the_template(qwen_tokenizer):
    """observation_max_tokens cuts the tool's output, never the chat template's tail: the next turn is
    still prompted as the assistant."""
    tok = qwen_tokenizer
    scripts = {"p0": ['<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>' + EOS, "done" + EOS]}
    long = FunctionTool("python", lambda a: ToolResult("word " * 300))
    _, (t,) = do_rollout(tok, HermesFormat(tok), scripts, Budgets(max_turns=3, max_tool_calls=2, observation_max_tokens=40),
                         {"python": long})
    obs = tok.decode(t.segments[1].token_ids)
    assert obs.startswith("\n<|im_start|>user\n<tool_response>\nword word")
    assert obs.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert 30 < len(t.segments[1].token_ids) <= 41  # a merge at the cut may add one
    assert t.tool_records[0].result.text == "word " * 300  # the record keeps the whole output


def test_hermes_names_an_eos_token_that_does_not_end_messages(qwen_tokenizer):
    import copy

    tok = copy.deepcopy(qwen_tokenizer)
    tok.eos_token = "<|endoftext|>"  # what a Qwen base tokenizer declares; the template ends messages with <|im_end|>
    with pytest.raises(ValueError, match=r"eos_token '<\|endoftext\|>' does not end the assistant message"):
        HermesFormat(tok).render([], [ToolResult("5")], "")
    tok.eos_token = None
    with pytest.raises(ValueError, match="needs tokenizer.eos_token"):
        HermesFormat(tok)


# --- budgets and stop reasons -----------------------------------------------------------------------------


CALL = "```python\nprint(1)\n```\n```output"


@pytest.mark.parametrize(
    ("budgets", "scripts", "reason", "n_segments"),
    [
        (Budgets(max_turns=2, max_tool_calls=1), [CALL, CALL], StopReason.MAX_TURNS, 3),
        (Budgets(max_turns=3, max_tool_calls=1), [CALL, CALL], StopReason.MAX_TOOL_CALLS, 3),
        (Budgets(max_turns=3, max_tool_calls=2, max_tokens_per_turn=4), ["word " * 20], StopReason.TURN_LENGTH, 1),
        (Budgets(max_turns=3, max_tool_calls=2, max_response_tokens=6), ["word " * 20], StopReason.RESPONSE_BUDGET, 1),
        (Budgets(max_turns=2, max_tool_calls=1), ["\\boxed{1}" + EOS], StopReason.EOS, 1),
    ],
)
def test_stop_reasons(tok, budgets, scripts, reason, n_segments):
    _, (t,) = do_rollout(tok, TorlFormat(), {"p0": scripts}, budgets, {"python": FunctionTool("python", run_python)})
    assert t.stop_reason == reason and len(t.segments) == n_segments
    if reason == StopReason.TURN_LENGTH:
        assert len(t.response_ids) == 4


def test_context_limit_counts_the_prompt(tok):
    prompt = prompt_of(tok, text="Q " * 10)
    limit = len(prompt.token_ids) + 3
    _, (t,) = do_rollout(tok, TorlFormat(), {"p0": ["word " * 20]}, Budgets(max_turns=1, max_context_tokens=limit),
                         {}, prompts=[prompt])
    assert t.stop_reason == StopReason.CONTEXT_LIMIT and len(prompt.token_ids) + len(t.response_ids) == limit


def test_stop_string_completing_on_the_last_allowed_token_is_a_tool_call(tok):
    n = len(tok.encode(CALL, add_special_tokens=False))
    budgets = Budgets(max_turns=2, max_tool_calls=1, max_tokens_per_turn=n)
    tool = FunctionTool("python", run_python)
    _, (t,) = do_rollout(tok, TorlFormat(), {"p0": [CALL, "\\boxed{1}" + EOS]}, budgets, {"python": tool})
    assert len(t.segments[0].token_ids) == n and len(tool.calls) == 1
    assert t.stop_reason == StopReason.EOS


def test_observation_that_would_overflow_the_context_is_not_appended(tok):
    prompt = prompt_of(tok)
    n_call = len(tok.encode(CALL, add_special_tokens=False))
    budgets = Budgets(max_turns=2, max_tool_calls=1, max_context_tokens=len(prompt.token_ids) + n_call + 3)
    big = FunctionTool("python", lambda a: ToolResult("x " * 200))
    _, (t,) = do_rollout(tok, TorlFormat(observation_max_chars=None), {"p0": [CALL]}, budgets, {"python": big}, prompts=[prompt])
    assert t.stop_reason == StopReason.CONTEXT_LIMIT
    assert [s.source for s in t.segments] == ["model"] and len(t.tool_records) == 1


def test_observation_max_tokens_cuts_the_tool_output_not_the_format(tok):
    wrapper = len(tok.encode("\n\n<information></information>\n\n", add_special_tokens=False))
    budgets = Budgets(max_turns=3, max_tool_calls=2, observation_max_tokens=wrapper + 6)
    long = FunctionTool("search", lambda a: ToolResult("many words " * 50))
    _, (t,) = do_rollout(tok, SearchR1Format(), {"p0": ["<search>q</search>", "<answer>a</answer>"]}, budgets, {"search": long})
    obs = tok.decode(t.segments[1].token_ids)
    assert obs.startswith("\n\n<information>many") and obs.endswith("</information>\n\n")
    assert wrapper < len(t.segments[1].token_ids) <= wrapper + 7


def test_observation_budget_is_shared_between_calls(qwen_tokenizer):
    tok = qwen_tokenizer
    call = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    scripts = {"p0": [call + "\n" + call + EOS, "done" + EOS]}
    outputs = iter(["alpha " * 200, "beta " * 200])
    tool = FunctionTool("python", lambda a: ToolResult(next(outputs)))
    _, (t,) = do_rollout(tok, HermesFormat(tok), scripts, Budgets(max_turns=3, max_tool_calls=2, observation_max_tokens=60),
                         {"python": tool})
    obs = tok.decode(t.segments[1].token_ids)
    assert obs.count("<tool_response>") == 2 and obs.count("alpha") >= 10 and obs.count("beta") >= 10
    assert len(t.segments[1].token_ids) <= 62


# --- failing tools ------------------------------------------------------------------------------------------


def test_a_tool_that_hangs_or_raises_becomes_an_observation(tok):
    def boom(arguments):
        raise ConnectionError("service down")

    slow = FunctionTool("python", run_python, delay_s=30)
    engine = ScriptedEngine(tok, {"p0": [CALL, "\\boxed{1}" + EOS], "p1": [CALL, "\\boxed{1}" + EOS]})
    cfg = RolloutConfig(n=1, tool_timeout_s=0.05)
    prompts = [prompt_of(tok, pid="p0"), prompt_of(tok, pid="p1")]
    budgets = Budgets(max_turns=2, max_tool_calls=1)
    (g0,) = run(rollout(prompts[:1], engine=engine, fmt=TorlFormat(), tools={"python": slow}, budgets=budgets, tokenizer=tok, config=cfg))
    t = g0.trajectories[0]
    assert t.tool_records[0].result.error == "no_answer" and "did not answer" in tok.decode(t.segments[1].token_ids)
    (g1,) = run(rollout(prompts[1:], engine=engine, fmt=TorlFormat(), tools={"python": FunctionTool("python", boom)},
                        budgets=budgets, tokenizer=tok, config=cfg))
    t = g1.trajectories[0]
    assert t.tool_records[0].result.error == "exception" and "service down" in tok.decode(t.segments[1].token_ids)
    assert t.stop_reason == StopReason.EOS


# --- void turns (SimpleTIR) ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "void"), [
    ("```python\nprint(1)\n```\n```output", False),
    ("```py\nprint(1)\n```\n```output", False),  # SimpleTIR runs ```py and bare ``` blocks as code too
    ("```\nprint(1)\n```" + EOS, False),
    ("So it is \\boxed{5}." + EOS, False),
    ("Then it is \\boxed{12", False),  # an opened \boxed{ is SimpleTIR's answer, closed or not
    ("no code here\n```output", True),
    ("```python\nprint(1)\n", True),  # a block that never closes is no code block
    ("```output\n5\n```", True),  # a fence opens code only bare or tagged py / python
    ("It is \\fbox{5}, i.e. \\boxed 5." + EOS, True),  # only the literal \boxed{ counts
    ("It is 5." + EOS, True),
])
def test_torl_void_turn(text, void):
    assert TorlFormat().is_void(text) is void


@pytest.mark.parametrize(("text", "void"), [
    ("<think>x</think><search> capital of France </search>", False),
    ("<answer> Paris </answer>", False),
    ("I just talk.</search>", True),
    ("<answer> Par", True),  # cut before </answer>: no answer in Search-R1's syntax
    ("I just talk." + EOS, True),
])
def test_search_r1_void_turn(text, void):
    assert SearchR1Format().is_void(text) is void


@pytest.mark.parametrize(("text", "void"), [
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>' + EOS, False),
    ("<tool_call>{oops}</tool_call>" + EOS, False),  # a call that fails is still a call, like code that fails
    ("So it is \\boxed{5}." + EOS, False),  # the math reward's answer
    ("<answer> Paris </answer>" + EOS, False),  # the QA rewards' answer
    ('<tool_call>{"name": "pyth', True),
    ("It is 5." + EOS, True),
])
def test_hermes_void_turn(tok, text, void):
    assert HermesFormat(tok).is_void(text) is void


def test_void_turns_are_counted_per_turn_whatever_ended_the_turn(tok):
    """A model turn whose own text has neither a code block nor a \\boxed{ answer is void: the last turn, a
    turn cut by its length or by the response budget included, and an answer in another turn excuses none."""
    scripts = {
        "clean": [CALL, "\\boxed{1}" + EOS],
        "earlier_answer": ["Maybe \\boxed{4}. Check:\n```python\nprint(2 + 2)\n```\n```output", "Hmm." + EOS],
        "invalid": ["no code here\n```output", "\\boxed{5}" + EOS],
        "cut": ["word " * 20],
        "cut_answer": ["\\boxed{" + "7" * 60],
    }
    budgets = Budgets(max_turns=3, max_tool_calls=2, max_tokens_per_turn=40)
    _, ts = do_rollout(tok, TorlFormat(), scripts, budgets, {"python": FunctionTool("python", run_python)})
    voids = {t.prompt.id: t.timings["void_turns"] for t in ts}
    assert voids == {"clean": 0, "earlier_answer": 1, "invalid": 1, "cut": 1, "cut_answer": 0}
    by_id = {t.prompt.id: t for t in ts}
    assert by_id["earlier_answer"].stop_reason == StopReason.EOS and "\\boxed{4}" in tok.decode(by_id["earlier_answer"].response_ids)
    assert by_id["cut"].stop_reason == by_id["cut_answer"].stop_reason == StopReason.TURN_LENGTH
    assert rollout_metrics(ts)["rollout/void_turns/mean"] == pytest.approx(3 / 5)

    n_call = len(tok.encode(CALL, add_special_tokens=False))
    n_obs = len(tok.encode("\n1\n```\n", add_special_tokens=False))
    budgets = Budgets(max_turns=3, max_tool_calls=2, max_response_tokens=n_call + n_obs + 10)
    _, (t,) = do_rollout(tok, TorlFormat(), {"p0": [CALL, "word " * 20]}, budgets, {"python": FunctionTool("python", run_python)})
    assert t.stop_reason == StopReason.RESPONSE_BUDGET and t.timings["void_turns"] == 1


# --- drivers, groups, metrics, dumps -------------------------------------------------------------------------


def test_async_and_turn_sync_give_the_same_trajectories(tok):
    scripts = {f"p{i}": [CALL if i % 2 else "\\boxed{1}" + EOS, "\\boxed{2}" + EOS] for i in range(4)}
    tools = {"python": FunctionTool("python", run_python)}
    budgets = Budgets(max_turns=2, max_tool_calls=1)
    _, a = do_rollout(tok, TorlFormat(), scripts, budgets, tools, n=2, mode="async")
    _, b = do_rollout(tok, TorlFormat(), scripts, budgets, tools, n=2, mode="turn_sync")
    assert [(t.prompt.id, t.sample, t.response_ids, t.stop_reason) for t in a] == \
           [(t.prompt.id, t.sample, t.response_ids, t.stop_reason) for t in b]
    assert [t.prompt.id for t in a] == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]


@pytest.mark.parametrize("mode", ["turn_sync", "async"])
def test_turn_sync_runs_every_first_turn_before_any_second(tok, mode):
    """One trajectory's tool gives up the event loop 50 times before answering (no wall-clock wait): the
    turn-synchronous loop still starts no second turn before it, the async loop does."""

    events: list[str] = []

    class Yielding(FunctionTool):
        async def call(self, call):
            if "7" in call.arguments["code"]:
                for _ in range(50):
                    await asyncio.sleep(0)
                events.append("slow tool done")
            return run_python(call.arguments)

    class Logging(ScriptedEngine):
        async def generate(self, prompt_ids, sampling, *, session=None):
            events.append(f"turn {self.turns[session]}")
            return await super().generate(prompt_ids, sampling, session=session)

    slow_call = "```python\nprint(7)\n```\n```output"
    scripts = {"p0": [slow_call, "\\boxed{7}" + EOS]} | {f"p{i}": [CALL, "\\boxed{2}" + EOS] for i in (1, 2)}
    prompts = [prompt_of(tok, pid=pid) for pid in scripts]
    run(rollout(prompts, engine=Logging(tok, scripts), fmt=TorlFormat(), tools={"python": Yielding("python", None)},
                budgets=Budgets(max_turns=2, max_tool_calls=1), tokenizer=tok, config=RolloutConfig(n=2, mode=mode)))
    assert events.count("turn 1") == 6 and events.count("slow tool done") == 2
    second_turns_before_the_slow_tools = events[: events.index("slow tool done")].count("turn 1")
    assert second_turns_before_the_slow_tools == (0 if mode == "turn_sync" else 4)  # the 4 fast trajectories


def test_metrics_and_dump(tok, tmp_path):
    scripts = {"p0": [CALL, "\\boxed{1}" + EOS], "p1": ["\\boxed{1}" + EOS]}
    _, ts = do_rollout(tok, TorlFormat(), scripts, Budgets(max_turns=2, max_tool_calls=1),
                       {"python": FunctionTool("python", run_python)}, n=2)
    m = rollout_metrics(ts)
    assert m["rollout/stop/eos"] == 1.0 and m["rollout/stop/max_turns"] == 0.0
    assert m["tool/calls_per_trajectory"] == 0.5 and m["tool/error_rate"] == 0.0
    assert m["rollout/turns/mean"] == 1.5
    assert m["rollout/response_length/max"] == max(len(t.response_ids) for t in ts)
    path = dump_trajectories(tmp_path / "samples.jsonl", ts, tok)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["segments"][1]["source"] == "tool" and rows[0]["tool_calls"][0]["name"] == "python"
    assert "".join(s["text"] for s in rows[0]["segments"]) == tok.decode(ts[0].response_ids)


@pytest.mark.parametrize("mode", ["async", "turn_sync"])
def test_a_failing_trajectory_stops_the_others(tok, mode):
    """An engine error ends the rollout with that error, and no other trajectory is left running: none may
    keep generating after the caller saw the failure (e.g. into weights it then updates)."""

    class Failing(ScriptedEngine):
        async def generate(self, prompt_ids, sampling, *, session=None):
            if session.startswith("bad"):
                raise RuntimeError("engine died for one request")
            return await super().generate(prompt_ids, sampling, session=session)

    class Hanging(Failing):  # the good trajectory's request never finishes on its own: only cancelling ends it
        async def generate(self, prompt_ids, sampling, *, session=None):
            if session.startswith("good"):
                await asyncio.Event().wait()
            return await super().generate(prompt_ids, sampling, session=session)

    slow = FunctionTool("python", run_python, delay_s=30)
    engine = (Hanging if mode == "turn_sync" else Failing)(tok, {"good": [CALL, "\\boxed{1}" + EOS]})
    prompts = [prompt_of(tok, pid="good"), prompt_of(tok, pid="bad")]

    async def main():
        with pytest.raises(RuntimeError, match="engine died"):
            await rollout(prompts, engine=engine, fmt=TorlFormat(), tools={"python": slow}, budgets=TORL_BUDGETS,
                          tokenizer=tok, config=RolloutConfig(n=1, mode=mode))
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert run(main()) == []


def test_tool_latency_percentiles_interpolate():
    from agentrl.rollout import _percentile

    assert _percentile([10.0, 20.0], 0.5) == 15.0
    assert _percentile([float(i) for i in range(1, 101)], 0.99) == pytest.approx(99.01)
    assert _percentile([7.0], 0.99) == 7.0 and _percentile([], 0.5) == 0.0


def test_builder_refuses_to_finish_early(tok):
    b = TrajectoryBuilder(prompt_of(tok), 0, TorlFormat(), Budgets(), tok)
    with pytest.raises(AssertionError):
        b.finish()
