"""Task specs -> dataset rows -> `Prompt`s: the first stage of the data flow.

The spec's schema is task_spec.py's; this file acts on it. `load_task()` validates a spec (config.py's
strict machinery, `--set` overrides included); `Task.rows()` loads, filters, shuffles and limits the
dataset (local .jsonl/.json/.parquet files read here, hub datasets through `datasets`); `Task.render()`
turns a row into the exact text and token ids the model sees, with the tokenizer `load_tokenizer()` gives.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, load_model
from agentrl.task_spec import TaskSpec
from agentrl.types import Prompt


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
        tools = self.tool_schemas if self.spec.tools.format == "hermes" else None
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    @functools.cached_property
    def tool_schemas(self) -> list[dict]:
        """The schemas of the task's tools, as the model sees them in its system prompt (hermes): the shared
        tools', then its environment's."""
        from agentrl.tools import tool_schemas

        envs = self.environments
        return tool_schemas(self.spec.tools) + (envs.schemas if envs is not None else [])

    @functools.cached_property
    def environments(self) -> Any:
        """The task's environment class (`environments.Environments`), or None; a ConfigError naming
        `tools.environment` when it cannot be loaded or described to the model."""
        from agentrl.environments import Environments

        spec = self.spec.tools.environment
        if spec is None:
            return None
        try:
            envs = Environments(spec)
            envs.schemas  # noqa: B018 - checks every tool method's signature now, not at the first call
        except ValueError as e:
            raise ConfigError(f"{self.source}: tools.environment.class: {e}") from None
        if clash := set(envs.names) & set(self.spec.tools.all_names):
            raise ConfigError(f"{self.source}: tools.environment: its tools {sorted(clash)} have the names of "
                              "other tools of the task")
        return envs

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
            # An environment's reset reads the whole row; other tasks carry no more than they need.
            metadata={"task": self.spec.name} | ({"row": row.fields} if self.spec.tools.environment else {}),
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
