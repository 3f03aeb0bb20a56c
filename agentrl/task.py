"""Task specs (tasks/*.yaml) -> dataset rows -> `Prompt`s: the first stage of the data flow.

A task spec says what the model is asked and how it is judged, never on what hardware: the dataset and
its field mapping, the prompt (a raw-text template or chat messages), the tool format and tools, the
reward by name, and the budgets the rollout (rollout.py) enforces. `load_task()` validates a spec
(config.py's strict machinery, `--set` overrides included); `Task.rows()` loads, filters, shuffles and
limits the dataset; `Task.render()` turns a row into the exact text and token ids the model sees.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from agentrl.config import ConfigError, StrictModel, load_model
from agentrl.types import Prompt

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
TOOL_FORMATS = ("torl", "search_r1", "hermes")
# The tool each single-tool format drives; hermes may drive any of them.
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


class ToolsSpec(StrictModel):
    format: Literal["torl", "search_r1", "hermes"] | None = None  # None: no tools, single-turn
    names: list[Literal["python", "search"]] = []
    search_topk: int = Field(3, ge=1, description="search: passages returned per query (Search-R1 uses 3)")

    @model_validator(mode="after")
    def _consistent(self) -> ToolsSpec:
        if self.format is None and self.names:
            raise ValueError(f"tools {self.names} need a tool format: one of {', '.join(TOOL_FORMATS)}")
        if self.format in FORMAT_TOOL and self.names != [FORMAT_TOOL[self.format]]:
            raise ValueError(f"format {self.format!r} drives exactly the tool [{FORMAT_TOOL[self.format]}]")
        if self.format == "hermes" and not self.names:
            raise ValueError("format 'hermes' needs at least one tool in names")
        return self


class RewardSpec(StrictModel):
    name: str
    params: dict[str, Any] = {}

    @model_validator(mode="after")
    def _known(self) -> RewardSpec:
        from agentrl.rewards import params_model  # lazy: rewards import the grader

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
        if b.observation_max_chars is not None and self.tools.format != "torl":
            raise ValueError(f"budgets.observation_max_chars is ToRL's head-and-tail cut; the {self.tools.format} "
                             "format does not apply it: use budgets.observation_max_tokens")
        if b.max_context_tokens and b.max_prompt_tokens and b.max_prompt_tokens >= b.max_context_tokens:
            raise ValueError("budgets.max_prompt_tokens must be below max_context_tokens")
        return self


class DataNotPrepared(ConfigError):
    """A local dataset file that is missing but that the spec's `dataset.made_by` writes: an error for
    whatever reads the rows, a note for `agentrl tasks validate` (a fresh clone has no such file yet)."""

    def __init__(self, message: str, *, path: str, command: str):
        super().__init__(message)
        self.path = path
        self.command = command


@dataclass(frozen=True)
class Row:
    """A dataset row with its question, ground truth and id resolved by the field mapping."""

    id: str
    question: str
    ground_truth: str | list[str]
    fields: dict[str, Any]


def load_task(path: str | Path, overrides: Sequence[str] = ()) -> Task:
    return Task(load_model(TaskSpec, path, overrides), source=str(path))


class Task:
    def __init__(self, spec: TaskSpec, source: str = "<task>"):
        self.spec = spec
        self.source = source
        self.dropped_too_long = 0

    # --- dataset ---------------------------------------------------------------------------------

    def check_dataset(self) -> None:
        """Fail early, naming the path, when a local dataset file is missing; `DataNotPrepared`, naming the
        command that writes it, when `dataset.made_by` says which does."""
        ds = self.spec.dataset
        if ds.is_local and not Path(ds.path).is_file():
            missing = f"{self.source}: dataset.path: no such file {ds.path!r}"
            where = f"(relative paths are taken from {Path.cwd()})"
            if ds.made_by is not None and ds.made_by.writes(ds.path):
                raise DataNotPrepared(f"{missing} yet {where}: `{ds.made_by.command}` writes it",
                                      path=ds.path, command=ds.made_by.command)
            raise ConfigError(f"{missing} {where}")

    def raw_rows(self) -> list[dict[str, Any]]:
        ds = self.spec.dataset
        self.check_dataset()
        if ds.is_local:
            return _read_local(Path(ds.path), self.source)
        import datasets  # lazy: slow to import, and only hub datasets need it

        try:
            data = datasets.load_dataset(ds.path, ds.config, split=ds.split)
        except Exception as e:  # the hub raises many types; the user needs the name and the reason
            raise ConfigError(f"{self.source}: dataset.path: cannot load hub dataset {ds.path!r}: {e}") from None
        return [dict(r) for r in data]

    def rows(self) -> list[Row]:
        ds = self.spec.dataset
        every = self.raw_rows()
        self._check_named_fields(every)
        raw = [(i, r) for i, r in enumerate(every) if all(c.holds(r) for c in ds.filter)]
        if ds.filter and every and not raw:
            raise ConfigError(f"{self.source}: dataset.filter: keeps none of the {len(every)} rows of {ds.path}")
        if ds.shuffle:
            random.Random(ds.seed).shuffle(raw)
        if ds.limit is not None:
            raw = raw[: ds.limit]
        return [self._resolve(i, r) for i, r in raw]

    def _check_named_fields(self, rows: list[dict[str, Any]]) -> None:
        """A filter's field that no row has is a typo: say so instead of dropping every row. (`fields.id`
        and `fields.answer` have fallbacks by design: the row's position, the solution's \boxed{}.)"""
        ds = self.spec.dataset
        present = set().union(*(r.keys() for r in rows))
        for i, c in enumerate(ds.filter):
            if rows and c.field not in present:
                raise ConfigError(f"{self.source}: dataset.filter[{i}].field: no row of {ds.path} has a field "
                                  f"{c.field!r}; they have: {', '.join(sorted(present))}")

    def _resolve(self, index: int, row: dict[str, Any]) -> Row:
        f, ds = self.spec.dataset.fields, self.spec.dataset
        where = f"{ds.path} row {index}"
        if f.question not in row:
            raise ConfigError(
                f"{self.source}: dataset.fields.question: {where} has no field {f.question!r}; "
                f"it has: {', '.join(sorted(row))}"
            )
        question = str(row[f.question]).strip()
        if ds.question_suffix and not question.endswith(ds.question_suffix):
            question += ds.question_suffix
        return Row(
            id=str(row[f.id]) if f.id is not None and f.id in row else str(index),
            question=question,
            ground_truth=self._ground_truth(row, where),
            fields=row,
        )

    def _ground_truth(self, row: dict[str, Any], where: str) -> str | list[str]:
        f, ds = self.spec.dataset.fields, self.spec.dataset
        answer = row.get(f.answer)
        if answer in (None, "", []) and f.solution and row.get(f.solution):
            from agentrl.rewards.math import extract_boxed

            answer = extract_boxed(str(row[f.solution]))
        if answer in (None, "", []):
            wanted = f"{f.answer!r}" + (f" or a \\boxed{{}} in {f.solution!r}" if f.solution else "")
            raise ConfigError(f"{self.source}: dataset.fields.answer: {where} has no answer in {wanted}")
        if ds.answer_regex is not None:
            m = re.search(ds.answer_regex, str(answer))
            if m is None:
                raise ConfigError(f"{self.source}: dataset.answer_regex: no match in the answer of {where}")
            answer = m.group(1).strip()
        if isinstance(answer, (list, tuple)) and all(isinstance(a, (str, int, float)) for a in answer):
            return [str(a) for a in answer]
        if not isinstance(answer, (str, int, float)):
            raise ConfigError(f"{self.source}: dataset.fields.answer: {where} has an answer of type "
                              f"{type(answer).__name__} ({str(answer)[:60]}); expected text, a number or a list of them")
        return str(answer)

    # --- prompts ---------------------------------------------------------------------------------

    def render_text(self, row: Row, tokenizer: Any = None) -> str:
        p = self.spec.prompt
        if p.template is not None:
            return _fill(p.template, row)
        if tokenizer is None:
            raise ValueError("a chat prompt needs a tokenizer with a chat template to render")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{self.source}: prompt.messages need a tokenizer with a chat template, and "
                              f"{getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} has none: use one that "
                              "has, or write the prompt as prompt.template")
        messages = [{"role": m.role, "content": _fill(m.content, row)} for m in p.messages or []]
        tools = None
        if self.spec.tools.format == "hermes":
            from agentrl.tools import TOOL_SCHEMAS

            tools = [TOOL_SCHEMAS[n] for n in self.spec.tools.names]
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def render(self, row: Row, tokenizer: Any) -> Prompt:
        text = self.render_text(row, tokenizer)
        # A raw template gets the tokenizer's own special tokens (BOS where the model has one); a chat
        # template already wrote them into the text.
        add_special = self.spec.prompt.template is not None
        ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        return Prompt(
            id=row.id,
            text=text,
            token_ids=tuple(ids),
            question=row.question,
            ground_truth=row.ground_truth,
            metadata={"task": self.spec.name},
        )

    def prompts(self, tokenizer: Any) -> Iterator[Prompt]:
        """Rendered prompts in dataset order; those over `budgets.max_prompt_tokens` are dropped and
        counted in `self.dropped_too_long` (ToRL and Search-R1 filter their data the same way)."""
        limit = self.spec.budgets.max_prompt_tokens
        self.dropped_too_long = 0
        for row in self.rows():
            prompt = self.render(row, tokenizer)
            if limit is not None and len(prompt.token_ids) > limit:
                self.dropped_too_long += 1
                continue
            yield prompt


_PLACEHOLDER = re.compile(r"\{(question|id)\}")


def _fill(template: str, row: Row) -> str:
    # Only {question} and {id} are placeholders: prompts are full of LaTeX braces (\boxed{}), so
    # str.format would mangle them.
    return _PLACEHOLDER.sub(lambda m: row.question if m.group(1) == "question" else row.id, template)


def _read_local(path: Path, source: str) -> list[dict[str, Any]]:
    # Read JSON ourselves rather than through Arrow: answers keep their exact text and type
    # ("1.0" stays "1.0"; a column mixing strings and lists does not break schema inference).
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except pa.ArrowException as e:
            raise ConfigError(f"{source}: dataset.path: {path} is not a readable parquet file: {e}") from None
    try:
        if path.suffix == ".jsonl":
            rows = []
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ConfigError(f"{source}: dataset.path: {path} line {n} is not valid JSON: {e.msg}") from None
            return _check_objects(rows, path, source)
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: dataset.path: {path} is not valid JSON (line {e.lineno}): {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: dataset.path: {path} is not UTF-8 text (byte {e.start}); expected JSON") from None
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]}
    if not isinstance(data, list):
        raise ConfigError(f"{source}: dataset.path: {path} must hold a JSON list of objects")
    return _check_objects(data, path, source)


def _check_objects(rows: list[Any], path: Path, source: str) -> list[dict[str, Any]]:
    for n, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ConfigError(f"{source}: dataset.path: {path} row {n} is {type(r).__name__}, expected an object")
    return rows


def load_tokenizer(name_or_path: str, option: str = "--tokenizer") -> Any:
    """A Hugging Face tokenizer from a local directory or a hub name (the local cache first). A hub name
    that is not cached fails at once when the hub cannot be reached, rather than after the hub client's
    retries, with an error saying to pass a local directory as `option`."""
    from transformers import AutoTokenizer

    if not Path(name_or_path).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError):
            require_hub(f"tokenizer {name_or_path!r}", f"pass a local tokenizer directory as {option}")
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer {name_or_path!r} cannot be loaded: {e}") from None


def require_hub(what: str, fix: str, timeout_s: float = 5.0) -> None:
    """Raise ConfigError naming `what` and saying `fix` when the Hugging Face hub is off
    (HF_HUB_OFFLINE) or cannot be reached."""
    import httpx
    from huggingface_hub import constants

    hint = "is neither a local directory nor in the Hugging Face cache, and"
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{what} {hint} HF_HUB_OFFLINE is set: {fix}")
    try:
        httpx.head(constants.ENDPOINT, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ConfigError(f"{what} {hint} the hub ({constants.ENDPOINT}) cannot be reached ({e}): {fix}") from None
