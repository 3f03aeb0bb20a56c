"""Tool formats: how a model asks for a tool in text, and how the answer is written back.

The rollout (rollout.py) decodes the ids of each model turn and asks the task's format to `parse` it:
`Calls` (run these tools), `Answer` (the trajectory is done), `Invalid` (show this message and let the
model go on), or None (the turn ended the trajectory). After the tools ran, `render` gives the
observation text, which the rollout tokenizes on its own and appends as a masked tool segment. A format
also says whether a turn is void (`is_void`, SimpleTIR's void turn): its text holds neither a tool call nor
a final answer, as written in the format's syntax, whether or not the call parses.

One parse-error policy for every format: a turn that asks for a tool in a way the format cannot run (ToRL's
```output without a complete code block, a Search-R1 stop string without its tag pair, Hermes JSON that
does not parse) is `Invalid`: the model sees the format's error message as the observation and goes on;
the rollout counts the turn in `rollout/invalid_turns` and records it as a failed call of kind
`malformed` (`tool/errors/malformed`), whatever the format.

- `TorlFormat` (ToRL): the model writes a ```python block and then "```output"; we run the last python
  block of the turn and append "\\n{output}\\n```\\n". Output past 256 characters keeps the first and last
  128 around "..."; an error keeps only its last line (ToRL's post-processing).
- `SearchR1Format` (Search-R1): `<search> q </search>` runs the retriever, `<answer> a </answer>` ends
  the trajectory, a turn stopped at a stop string without a parsable action gets Search-R1's invalid-action
  message, and a turn that ended on EOS without an action ends the trajectory.
- `TagsFormat`: ToRL's code blocks and Search-R1's tags in one format, for a task whose model may both
  compute and search; the stop string that ended the turn says which tool it called.
- `HermesFormat` (Hermes / Qwen JSON): `<tool_call>{"name", "arguments"}</tool_call>` blocks in an
  assistant message that ends with EOS; tool messages are rendered by the tokenizer's chat template, and
  only the part appended after the model's EOS is tokenized (see `HermesFormat.render`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from agentrl.types import ToolCall, ToolResult


@dataclass(frozen=True)
class Calls:
    calls: list[ToolCall]


@dataclass(frozen=True)
class Answer:
    text: str


@dataclass(frozen=True)
class Invalid:
    """A turn that asked for something the format cannot run; `message` is the observation."""

    reason: str
    message: str


Action = Calls | Answer | Invalid | None


class ToolFormat(ABC):
    name: str = ""
    stop: tuple[str, ...] = ()

    @abstractmethod
    def parse(self, text: str, stop: str | None) -> Action:
        """`text`: the decoded model turn, cut right after the stop string `stop` that ended it (None when
        it ended on EOS)."""

    @abstractmethod
    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        """The observation text for the results of `calls`; `turn_text` is the model turn before it, decoded
        from its ids: past the stop string when the last token carried more (e.g. "output\n")."""

    def render_invalid(self, invalid: Invalid, turn_text: str) -> str:
        return invalid.message

    def has_call(self, text: str) -> bool:
        """Whether the model turn `text` writes a complete tool call in this format's syntax, parsable or not:
        SimpleTIR counts code that fails as code. Unless a format knows better: the turn reached one of its
        stop strings, which end its calls."""
        return any(s in text for s in self.stop)

    def has_answer(self, text: str) -> bool:
        """Whether the model turn `text` writes a final answer in the form this format's tasks are graded on;
        unless a format knows better, either form the project's rewards read."""
        return has_graded_answer(text)

    def is_void(self, text: str) -> bool:
        """SimpleTIR's void turn: the model turn `text` (all of it, however the turn ended) holds neither a
        tool call nor a final answer."""
        return not (self.has_call(text) or self.has_answer(text))


# SimpleTIR's final answer is an opened \boxed{, closed or not: a turn cut inside its answer has one.
BOXED_OPENER = "\\boxed{"
# A fenced block SimpleTIR would run: a bare, py or python fence ending its line, up to a closing fence at the
# start of a line (an empty body still needs its own line).
_FENCED_CODE = re.compile(r"```(?:py|python)?\n.*?\n```", re.DOTALL)
_QA_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


def has_graded_answer(text: str) -> bool:
    """An answer one of the project's rewards reads (rewards/math.py a \\boxed{, rewards/qa.py an <answer>
    pair): for formats whose syntax has no answer of its own, so either form counts."""
    return BOXED_OPENER in text or _QA_ANSWER.search(text) is not None


# --- ToRL ---------------------------------------------------------------------------------------------


def last_python_block(text: str) -> str | None:
    """The code of the last complete ```python block (ToRL's rule: a line starting or ending with
    ```python opens it, a line starting with ``` closes it). None when there is none or it is open."""
    code: list[str] | None = None
    block: list[str] | None = None
    for line in text.split("\n"):
        if line.startswith("```python") or line.endswith("```python"):
            block = []
        elif line.startswith("```"):
            if block is not None:
                code, block = block, None
        elif block is not None:
            block.append(line)
    if block is not None or code is None:
        return None
    return "".join(line + "\n" for line in code)


def truncate_middle(text: str, max_chars: int) -> str:
    """ToRL: past `max_chars` characters, keep the first and the last `max_chars // 2` around '...'."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + "..." + text[-half:]


class TorlFormat(ToolFormat):
    name = "torl"
    stop = ("```output",)

    def __init__(self, observation_max_chars: int | None = 256):
        self.max_chars = observation_max_chars

    def parse(self, text: str, stop: str | None) -> Action:
        if stop != "```output":
            return None
        code = last_python_block(text[: text.rfind("```output")])
        if code is None:
            return Invalid("no_code", "Error: there is no complete ```python block to run before ```output")
        return Calls([ToolCall("python", {"code": code}, raw=code)])

    def _observation(self, result: ToolResult) -> str:
        out = result.text.strip()
        if not result.ok:
            # ToRL shows only the last line of an error (the exception, not the traceback).
            lines = [line for line in out.split("\n") if line.strip()]
            out = lines[-1].strip() if lines else f"Error: {result.error}"
        return truncate_middle(out, self.max_chars) if self.max_chars else out

    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        return self._wrap(self._observation(results[0]), turn_text)

    def render_invalid(self, invalid: Invalid, turn_text: str) -> str:
        return self._wrap(invalid.message, turn_text)

    def has_call(self, text: str) -> bool:
        # SimpleTIR's code block, wider than the ```python block run here: a ```py turn is an invalid action
        # yet not void, as in SimpleTIR, where it would have run.
        return _FENCED_CODE.search(text) is not None

    def has_answer(self, text: str) -> bool:
        return BOXED_OPENER in text

    @staticmethod
    def _wrap(observation: str, turn_text: str) -> str:
        # The model's "```output" is already in the text; when its last token also carried the newline,
        # the observation does not add a second one.
        lead = "" if turn_text.endswith("\n") else "\n"
        return f"{lead}{observation}\n```\n"


# --- Search-R1 ----------------------------------------------------------------------------------------

SEARCH_R1_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
_SEARCH_R1_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_SEARCH_R1_CALL = re.compile(r"<search>.*?</search>", re.DOTALL)


class SearchR1Format(ToolFormat):
    name = "search_r1"
    stop = ("</search>", "</answer>")

    def parse(self, text: str, stop: str | None) -> Action:
        m = _SEARCH_R1_ACTION.search(text)
        if m is None:
            # After EOS the model has ended its message: a message appended there would follow the EOS in the
            # ids it trains on.
            return None if stop is None else Invalid("no_action", SEARCH_R1_INVALID)
        if m.group(1) == "answer":
            return Answer(m.group(2).strip())
        return Calls([ToolCall("search", {"query": m.group(2).strip()}, raw=m.group(0))])

    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        # Search-R1 writes "</search>\n\n<information>". When the token that completed "</search>" also
        # carried newlines (Qwen's ">\n\n"), they are already in the context: add only the missing ones.
        after = turn_text[turn_text.rfind("</search>") + len("</search>"):] if "</search>" in turn_text else ""
        have = len(after) - len(after.lstrip("\n"))
        return f"{chr(10) * max(0, 2 - have)}<information>{results[0].text.strip()}</information>\n\n"

    def has_call(self, text: str) -> bool:
        return _SEARCH_R1_CALL.search(text) is not None

    def has_answer(self, text: str) -> bool:
        return _QA_ANSWER.search(text) is not None  # a complete pair, as parse and rewards/qa.py read it


# --- ToRL and Search-R1 together ----------------------------------------------------------------------


class TagsFormat(ToolFormat):
    """ToRL's ```python blocks (the `python` tool) and Search-R1's `<search>` tags (the `search` tool) in one
    format, for the tools in `names`; `<answer>` ends the trajectory where `search` is among them, as does a
    turn that ends on EOS. Each part keeps its own syntax and observation: the stop string that ended the
    turn picks the part that parses it and renders its result."""

    name = "tags"

    def __init__(self, names: list[str], observation_max_chars: int | None = 256):
        if not names or not set(names) <= {"python", "search"}:
            raise ValueError(f"the tags format drives the tools python and search; got {names}")
        self.parts: dict[str, ToolFormat] = {}
        if "python" in names:
            self.parts["python"] = TorlFormat(observation_max_chars)
        if "search" in names:
            self.parts["search"] = SearchR1Format()
        self.stop = tuple(s for part in self.parts.values() for s in part.stop)

    def _part(self, stop: str | None) -> ToolFormat | None:
        return next((p for p in self.parts.values() if stop in p.stop), None)

    def parse(self, text: str, stop: str | None) -> Action:
        part = self._part(stop)
        return None if part is None else part.parse(text, stop)

    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        return self.parts[calls[0].name].render(calls, results, turn_text)

    def render_invalid(self, invalid: Invalid, turn_text: str) -> str:
        part = self.parts["python"] if invalid.reason == "no_code" else self.parts["search"]
        return part.render_invalid(invalid, turn_text)

    def has_call(self, text: str) -> bool:
        return any(p.has_call(text) for p in self.parts.values())

    def has_answer(self, text: str) -> bool:
        return any(p.has_answer(text) for p in self.parts.values())


# --- Hermes / Qwen JSON tool calls --------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesFormat(ToolFormat):
    """Tool calls in Hermes / Qwen2.5 style, inside an assistant message that ends with EOS.

    Observations are what the chat template appends after the model's message: for Qwen2.5,
    "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n".
    We render it as the difference between the template applied to a conversation with and without the
    tool messages, and tokenize only that part. The ids then equal a full re-render of the conversation
    when (a) the model wrote its tool call exactly as the template would (the template re-serialises
    `arguments` with its own JSON spacing and key order), (b) the template renders earlier turns
    unchanged (templates that drop earlier reasoning, like Qwen3's <think> stripping, rewrite history),
    and (c) the boundary is a special token, so no BPE merge crosses it. Where they differ, the
    incremental ids are the right ones: they are what the model saw and sampled.
    """

    name = "hermes"
    stop = ()  # the message ends with EOS (<|im_end|> for Qwen); all its tool calls are parsed then

    def __init__(self, tokenizer: Any, tool_schemas: list[dict] | None = None):
        if not tokenizer.eos_token:
            raise ValueError("the hermes format needs tokenizer.eos_token: the token that ends an assistant message "
                             "(<|im_end|> for Qwen), after which the chat template appends tool messages")
        self.tokenizer = tokenizer
        self.tool_schemas = tool_schemas
        self.eos_text = tokenizer.eos_token

    def parse(self, text: str, stop: str | None) -> Action:
        blocks = _TOOL_CALL.findall(text)
        if not blocks:
            return None
        calls = []
        for block in blocks:
            try:
                obj = json.loads(block)
                name, arguments = obj["name"], obj.get("arguments", {})
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise TypeError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: deeply nested JSON
                message = f'Error: the tool call is not valid JSON of the form {{"name": ..., "arguments": {{...}}}}: {e}'
                return Invalid("malformed", message)
            calls.append(ToolCall(name, arguments, raw=block))
        return Calls(calls)

    _HISTORY = (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
    )

    @cached_property
    def _before(self) -> tuple[str, int]:
        """The template over a user turn and an assistant message with a tool call, and the index just past
        that message's EOS: the same for every observation of this format, so rendered once."""
        before = self.tokenizer.apply_chat_template(list(self._HISTORY), tools=self.tool_schemas, tokenize=False)
        if self.eos_text not in before:
            raise ValueError(f"tokenizer.eos_token {self.eos_text!r} does not end the assistant message in this chat "
                             f"template, which renders it as ...{before[-80:]!r}: set eos_token to the template's "
                             "end-of-message token (<|im_end|> for Qwen)")
        return before, before.rindex(self.eos_text) + len(self.eos_text)

    def _appended(self, contents: list[str]) -> str:
        """What the template appends after an assistant message with tool calls when tool messages with
        `contents` follow, starting right after the assistant's EOS."""
        before, end_of_message = self._before
        tools = [{"role": "tool", "content": c} for c in contents]
        after = self.tokenizer.apply_chat_template([*self._HISTORY, *tools], tools=self.tool_schemas, tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("this chat template does not append tool messages after the assistant's EOS")
        return before[end_of_message:] + after[len(before) :]

    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        return self._appended([r.text for r in results])

    def render_invalid(self, invalid: Invalid, turn_text: str) -> str:
        return self._appended([invalid.message])

    def has_call(self, text: str) -> bool:
        return _TOOL_CALL.search(text) is not None

    # has_answer: either answer form (the base's): a message without a tool call ends the conversation, yet
    # SimpleTIR asks for an answer in it, and which reward grades a Hermes task is the task's choice.


class NoTools(ToolFormat):
    """A task without tools: no stop strings, and every turn ends the trajectory."""

    name = "none"

    def parse(self, text: str, stop: str | None) -> Action:
        return None

    def render(self, calls: list[ToolCall], results: list[ToolResult], turn_text: str) -> str:
        raise RuntimeError("a task without tools renders no tool results")


def build_format(name: str | None, *, tokenizer: Any = None, observation_max_chars: int | None = None,
                 tool_schemas: list[dict] | None = None, names: list[str] | None = None) -> ToolFormat:
    """The format a task spec's `tools.format` names, over its built-in tools `names` (the tags format's
    parts); None: the task has no tools."""
    if name is None:
        return NoTools()
    if name == "torl":
        return TorlFormat(observation_max_chars if observation_max_chars is not None else 256)
    if name == "search_r1":
        return SearchR1Format()
    if name == "tags":
        return TagsFormat(names or [], observation_max_chars if observation_max_chars is not None else 256)
    if name == "hermes":
        if tokenizer is None:
            raise ValueError("the hermes format renders tool messages with a tokenizer's chat template")
        return HermesFormat(tokenizer, tool_schemas)
    raise ValueError(f"unknown tool format {name!r}; expected one of: torl, search_r1, tags, hermes")
