"""Task specs (tasks/*.yaml): what the model is asked and how it is judged, never on what hardware.

The schema of a spec, in config.py's strict models: the dataset and its field mapping (filter conditions,
the command that writes local data files), the prompt (a raw-text template or chat messages), the tool
format and tools, the reward by name (its params checked against the reward's own model), and the
budgets the rollout (rollout.py) enforces. task.py loads a spec (`load_task()`) and turns it into `Prompt`s.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from agentrl.config import StrictModel

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
TOOL_FORMATS = ("torl", "search_r1", "tags", "hermes")
# The tool each single-tool format drives; tags drives python and search together, hermes any tool.
FORMAT_TOOL = {"torl": "python", "search_r1": "search"}
KNOWN_TOOLS = ("python", "search")


class Fields(StrictModel):
    """Which dataset columns hold what. The defaults read MATH-style rows."""

    question: str = "problem"
    answer: str = "answer"
    solution: str | None = "solution"  # when `answer` is absent or empty: the last \boxed{} of this field
    id: str | None = None  # None, or a row without this field: the row's position in the file


class Condition(StrictModel):
    field: str
    op: Literal["eq", "ne", "in", "not_in", "lt", "le", "gt", "ge", "contains"] = "eq"
    value: Any

    @model_validator(mode="after")
    def _list_for_membership(self) -> Condition:
        if self.op in ("in", "not_in") and not isinstance(self.value, list):
            raise ValueError(f"op {self.op!r} needs a list as value, got {self.value!r}")
        return self

    def holds(self, row: dict[str, Any]) -> bool:
        if self.field not in row:
            return False
        x, v = row[self.field], self.value
        if self.op in ("in", "not_in"):
            return (x in v) == (self.op == "in")
        if self.op == "contains":
            try:
                return v in x
            except TypeError:  # the row's value holds nothing (a number): it does not contain v
                return False
        ops = {"eq": x == v, "ne": x != v}
        if self.op in ops:
            return ops[self.op]
        try:
            return {"lt": x < v, "le": x <= v, "gt": x > v, "ge": x >= v}[self.op]
        except TypeError:
            return False


class MadeBy(StrictModel):
    """The command that writes a spec's local data files, for files a fresh clone does not have (generated,
    or downloaded). It speaks for `files` only, so a dataset.path changed by --set or a run config does
    not inherit it."""

    command: str
    files: str = Field(description='the file it writes, or a directory ending in "/": every file under it')

    def writes(self, path: str) -> bool:
        made, asked = os.path.abspath(self.files), os.path.abspath(path)
        return asked.startswith(made + os.sep) if self.files.endswith("/") else asked == made


class DatasetSpec(StrictModel):
    path: str = Field(description="a local .jsonl/.json/.parquet file, or a hub dataset name")
    made_by: MadeBy | None = None
    config: str | None = None
    split: str = "train"
    fields: Fields = Fields()
    answer_regex: str | None = None  # the ground truth is group 1 of this pattern in the answer text
    question_suffix: str | None = None  # appended when the stripped question does not already end with it
    filter: list[Condition] = []
    shuffle: bool = False
    seed: int = 0
    limit: int | None = Field(default=None, ge=1)

    @property
    def is_local(self) -> bool:
        return self.path.endswith(LOCAL_SUFFIXES)

    @model_validator(mode="after")
    def _regex_compiles(self) -> DatasetSpec:
        if self.answer_regex is not None:
            try:
                if re.compile(self.answer_regex).groups < 1:
                    raise ValueError("it needs one capture group, e.g. '####\\s*(.+)'")
            except re.error as e:
                raise ValueError(f"answer_regex {self.answer_regex!r} is not a valid pattern: {e}") from None
        return self


class Message(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class PromptSpec(StrictModel):
    """Exactly one of: `template`, raw text the model sees as is (base models, ToRL), or `messages`,
    rendered with the tokenizer's chat template (instruct models). `{question}` marks the question."""

    template: str | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> PromptSpec:
        if (self.template is None) == (self.messages is None):
            raise ValueError("give exactly one of 'template' (raw text) or 'messages' (chat)")
        texts = [self.template] if self.template is not None else [m.content for m in self.messages or []]
        if not any("{question}" in t for t in texts):
            raise ValueError("the prompt must contain the placeholder {question}")
        return self


class FunctionToolSpec(StrictModel):
    """A Python function the model may call (tools/functions.py)."""

    function: str = Field(description="'path/to/file.py:name' (relative to the working directory) or "
                                      "'package.module:name'")
    name: str | None = Field(None, description="the name the model calls it by (default: the function's)")
    description: str | None = Field(None, description="what the model reads (default: the docstring's first "
                                                      "paragraph)")
    parameters: dict[str, Any] | None = Field(None, description="its JSON schema (default: from the signature)")
    timeout_s: float = Field(30.0, gt=0, description="a call still running after this is ended")

    @model_validator(mode="before")
    @classmethod
    def _named(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("function"), str):
            module, sep, attr = data["function"].rpartition(":")
            if not (sep and module and attr):
                raise ValueError(f"function {data['function']!r}: expected 'path/to/file.py:name' or "
                                 "'package.module:name'")
            data = {**data, "name": data.get("name") or attr}
        return data

    @model_validator(mode="after")
    def _name_is_plain(self) -> FunctionToolSpec:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name or ""):
            raise ValueError(f"tool name {self.name!r}: letters, digits, '_', '.' and '-' only")
        return self


class MCPServerSpec(StrictModel):
    """An MCP server whose tools the model may call (tools/mcp.py): a command agentrl starts (stdio), or a URL."""

    command: list[str] | None = Field(None, description="the command that starts it, talking MCP over stdio "
                                      "(a program `python` is the trainer's own interpreter)")
    url: str | None = Field(None, description="a server already running (Streamable HTTP)")
    env: dict[str, str] = Field({}, description="command: its environment (default: the trainer's)")
    timeout_s: float = Field(30.0, gt=0, description="a call still unanswered after this is a timeout")
    startup_timeout_s: float = Field(60.0, gt=0, description="for the server to start and answer")

    @property
    def label(self) -> str:
        return self.url or " ".join(self.command or [])

    @model_validator(mode="after")
    def _one_way(self) -> MCPServerSpec:
        if (self.command is None) == (self.url is None) or self.command == []:
            raise ValueError("give exactly one of 'command' (a list: the program and its arguments) or 'url'")
        return self


class EnvironmentSpec(StrictModel):
    """A stateful environment (environments.py): one object of the class per trajectory, its methods the tools."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              serialize_by_alias=True)  # written back as `class`, as users write it

    class_: str = Field(alias="class", description="'path/to/file.py:Name' or 'package.module:Name', a subclass "
                                                   "of agentrl.environments.Environment")
    params: dict[str, Any] = Field({}, description="the keyword arguments each object is made with")
    timeout_s: float = Field(30.0, gt=0, description="reset, a step or close still running after this errors "
                                                     "the trajectory")
    threads: int = Field(16, ge=1, description="threads that run the class's sync methods, for all trajectories")

    @model_validator(mode="after")
    def _ref(self) -> EnvironmentSpec:
        module, sep, attr = self.class_.rpartition(":")
        if not (sep and module and attr):
            raise ValueError(f"class {self.class_!r}: expected 'path/to/file.py:Name' or 'package.module:Name'")
        return self


class ToolsSpec(StrictModel):
    format: Literal["torl", "search_r1", "tags", "hermes"] | None = None  # None: no tools, single-turn
    names: list[Literal["python", "search"]] = []
    search_topk: int = Field(3, ge=1, description="search: passages returned per query (Search-R1 uses 3)")
    functions: list[FunctionToolSpec] = Field([], description="Python functions as tools (format hermes; in a tag "
                                              "format, one named python or search stands in for that service)")
    workers: int = Field(4, ge=1, description="processes that run the function tools' calls")
    mcp: list[MCPServerSpec] = Field([], description="MCP servers whose tools the model may call (format hermes)")
    environment: EnvironmentSpec | None = Field(None, description="a class whose methods are the tools, one "
                                                                  "object per trajectory (format hermes)")

    @property
    def all_names(self) -> list[str]:
        """Every tool the model may call: the built-in ones, then the functions."""
        return [*self.names, *(f.name for f in self.functions)]

    @model_validator(mode="after")
    def _consistent(self) -> ToolsSpec:
        if self.format is None and (self.all_names or self.mcp or self.environment):
            raise ValueError(f"tools {self.all_names or 'of MCP servers or an environment'} need a tool format: "
                             f"one of {', '.join(TOOL_FORMATS)}")
        # A tag format calls its built-in tools by name; a function of that name stands in for the service.
        custom = self.mcp or self.environment or [f for f in self.functions if f.name not in KNOWN_TOOLS]
        if self.format in FORMAT_TOOL and (self.all_names != [FORMAT_TOOL[self.format]] or custom):
            raise ValueError(f"format {self.format!r} drives exactly the tool [{FORMAT_TOOL[self.format]}], in names "
                             "or as a function of that name"
                             + ("; other function, MCP and environment tools need format hermes" if custom else ""))
        if self.format == "tags" and (custom or not self.all_names):
            raise ValueError("format 'tags' drives the tools python and search (names: [python, search], either "
                             "one, or functions of those names); other function, MCP and environment tools need "
                             "format hermes")
        if self.format == "hermes" and not (self.all_names or self.mcp or self.environment):
            raise ValueError("format 'hermes' needs at least one tool, in names, functions, mcp or environment")
        seen = set()
        for name in self.all_names:
            if name in seen:
                raise ValueError(f"two tools are named {name!r}: give one a `name`")
            seen.add(name)
        return self


class RewardSpec(StrictModel):
    """Exactly one of: `name`, a built-in reward (its `params` checked against its own model), or
    `function`, the user's own (rewards/function.py; `params` are its keyword arguments)."""

    name: str | None = None
    function: str | None = Field(None, description="'path/to/file.py:name' or 'package.module:name'")
    params: dict[str, Any] = {}
    timeout_s: float = Field(30.0, gt=0, description="function: a call still running after this errors its "
                                                     "trajectory")

    @property
    def label(self) -> str:
        return self.name or f"function {self.function}"

    @model_validator(mode="after")
    def _known(self) -> RewardSpec:
        from agentrl.rewards import params_model  # lazy: rewards import the grader

        if (self.name is None) == (self.function is None):
            raise ValueError("give exactly one of 'name' (a built-in reward) or 'function' (your own)")
        if self.function is not None:
            module, sep, attr = self.function.rpartition(":")
            if not (sep and module and attr):
                raise ValueError(f"function {self.function!r}: expected 'path/to/file.py:name' or "
                                 "'package.module:name'")
            return self

        model = params_model(self.name)
        try:
            model.model_validate(self.params)
        except ValidationError as e:  # name the keys under `params`, and the ones this reward takes
            problems = []
            for err in e.errors():
                loc = ".".join(["params", *(str(p) for p in err["loc"])])
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown key {loc!r}; {self.name} takes: {', '.join(model.model_fields)}")
                else:
                    problems.append(f"{loc}: got {err.get('input')!r}: {err['msg']}")
            raise ValueError("; ".join(problems)) from None
        return self


class Budgets(StrictModel):
    """Every limit of a trajectory, each one explicit here. Token counts are engine tokens."""

    max_turns: int = Field(default=1, ge=1)  # model generations in one trajectory
    max_tool_calls: int = Field(default=0, ge=0)
    max_tokens_per_turn: int | None = Field(default=None, ge=1)
    max_response_tokens: int = Field(default=1024, ge=1)  # model + observation tokens after the prompt
    max_prompt_tokens: int | None = Field(default=None, ge=1)  # longer prompts are dropped at load
    max_context_tokens: int | None = Field(default=None, ge=1)  # prompt + response
    observation_max_chars: int | None = Field(default=None, ge=2)  # ToRL: keep head and tail halves
    observation_max_tokens: int | None = Field(default=None, ge=1)  # tool output cut to fit (rollout._fitted)
    # Calls each named tool may take in one trajectory, within max_tool_calls; a call past its tool's share
    # is answered with an error observation (tool/errors/budget) and the model goes on.
    max_calls_per_tool: dict[str, int] = {}


class TaskSpec(StrictModel):
    name: str
    description: str = ""
    dataset: DatasetSpec
    prompt: PromptSpec
    tools: ToolsSpec = ToolsSpec()
    reward: RewardSpec
    budgets: Budgets = Budgets()

    @model_validator(mode="after")
    def _budgets_fit_tools(self) -> TaskSpec:
        b = self.budgets
        if self.tools.format is not None and b.max_tool_calls == 0:
            raise ValueError("budgets.max_tool_calls is 0 but the task has tools; set it to at least 1")
        if b.max_tool_calls >= b.max_turns:
            raise ValueError(
                f"budgets.max_turns ({b.max_turns}) must exceed max_tool_calls ({b.max_tool_calls}): "
                "the model needs a turn after its last tool call to answer"
            )
        for name, count in b.max_calls_per_tool.items():
            if count < 1:
                raise ValueError(f"budgets.max_calls_per_tool.{name}: got {count}; expected at least 1")
            if name not in self.tools.all_names and not (self.tools.mcp or self.tools.environment):
                raise ValueError(f"budgets.max_calls_per_tool names {name!r}, which is not a tool of this task; "
                                 f"its tools: {', '.join(self.tools.all_names) or 'none'}")
        if self.reward.name == "environment" and self.tools.environment is None:
            raise ValueError("reward 'environment' sums the rewards a task's environment gives; this task has no "
                             "tools.environment")
        if b.observation_max_chars is not None and self.tools.format not in ("torl", "tags"):
            raise ValueError(f"budgets.observation_max_chars is ToRL's head-and-tail cut; the {self.tools.format} "
                             "format does not apply it: use budgets.observation_max_tokens")
        if b.max_context_tokens and b.max_prompt_tokens and b.max_prompt_tokens >= b.max_context_tokens:
            raise ValueError("budgets.max_prompt_tokens must be below max_context_tokens")
        return self
