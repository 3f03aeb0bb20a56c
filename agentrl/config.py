"""Strict configuration: YAML files -> `--set a.b.c=value` overrides -> pydantic models.

Every YAML file of the project (task specs in tasks/, run configs in configs/) is loaded by
`load_model()`. Models derive from `StrictModel` (unknown keys are errors). A `ConfigError` names the
file, the key path, the bad value and what was expected, one line per problem. `write_resolved()`
writes the config a run actually used into its run directory, atomically.

Relative paths inside configs are taken relative to the working directory the command runs in (the
repository root in every example), whether they come from a file or from `--set`.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config problem, already phrased for the user: `source: key.path: what is wrong`."""


def parse_override(text: str) -> tuple[list[str], str]:
    """`a.b.c=value` -> (["a", "b", "c"], "value"). The value is coerced later, by the field's type."""
    key, sep, value = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. dataset.limit=100")
    return path, value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: plain YAML keeps the
    last one, silently dropping what the first one set."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_model(model_cls: type[M], path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> M:
    """Load `path` (YAML) into `model_cls`, applying `--set` overrides first."""
    return validate(model_cls, apply_overrides(read_yaml(path), overrides, model_cls), str(path))


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping at the top of YAML file `path`; ConfigError naming the file for anything else."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a directory, expected a YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start}), expected a YAML file") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader that refuses duplicate keys
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def validate(model_cls: type[M], data: Mapping[str, Any], source: str) -> M:
    """Validate `data` into `model_cls`, turning pydantic's errors into one line per problem."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError("\n".join(_describe(err, model_cls, source) for err in e.errors())) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str], model_cls: type[BaseModel]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b.c=value` applied; values are coerced by the field's type."""
    out = _deep_copy(data)
    for text in overrides:
        path, raw = parse_override(text)
        annotation = _annotation_at(model_cls, path, source=f"--set {text!r}")
        node = out
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {text!r}: {where} holds {child!r}, not a mapping of keys")
            node = child
        node[path[-1]] = _coerce(raw, annotation)
    return out


def write_resolved(model: BaseModel, run_dir: str | os.PathLike[str], name: str = "config.yaml") -> Path:
    """Write the resolved config into `run_dir/name` atomically (a reader never sees half a file)."""
    text = yaml.safe_dump(model.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=120)
    return atomic_write_text(Path(run_dir) / name, text)


def atomic_write_text(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 is for secrets; results and configs are ordinary files
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --- key paths and types --------------------------------------------------------------------------


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of a Union / Optional annotation (or the annotation itself)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return [annotation]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _annotation_at(model_cls: type[BaseModel], path: list[str], source: str) -> Any:
    """The annotation of the field at `path`, or None where the schema allows anything.
    Raises ConfigError for a key that the model does not have, with the keys it does have."""
    current: Any = model_cls
    for i, key in enumerate(path):
        models = [a for a in _unwrap(current) if _is_model(a)]
        mappings = [a for a in _unwrap(current) if typing.get_origin(a) in (dict, Mapping)]
        if models:
            fields = {f.alias or k: f for m in models for k, f in m.model_fields.items()}  # as a YAML file writes it
            if key not in fields:
                where = ".".join(path[: i + 1])
                raise ConfigError(f"{source}: unknown key {where!r}; {_expected_keys(key, fields)}")
            current = fields[key].annotation
        elif mappings:
            current = typing.get_args(mappings[0])[1] if typing.get_args(mappings[0]) else None
        elif current is None or current is Any:
            return None
        else:
            parent = ".".join(path[:i])
            raise ConfigError(f"{source}: unknown key {'.'.join(path[: i + 1])!r}; {parent} takes a value, not keys")
    return current


def _expected_keys(key: str, fields: Iterable[str]) -> str:
    names = sorted(fields)
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"expected one of: {', '.join(names)}{hint}"


def _coerce(raw: str, annotation: Any) -> Any:
    """Parse a `--set` value as YAML (3 -> int, true -> bool, [1, 2] -> list), except where the field
    is a string, a path or a string choice: there the text is kept as written ("no" stays "no"), bar one
    pair of enclosing quotes, which is how a value with leading or trailing spaces is written."""
    alternatives = _unwrap(annotation) if annotation is not None else []
    stringy = bool(alternatives) and all(
        a in (str, Path) or (typing.get_origin(a) is typing.Literal and all(isinstance(v, str) for v in typing.get_args(a)))
        for a in alternatives
    )
    optional = annotation is not None and type(None) in typing.get_args(annotation)
    if stringy and not (optional and raw.strip().lower() in ("null", "none", "~")):
        quoted = raw.strip()
        if len(quoted) >= 2 and quoted[0] == quoted[-1] and quoted[0] in "'\"":  # `" ?"` means ` ?`
            try:
                unquoted = yaml.safe_load(quoted)
            except yaml.YAMLError:
                return raw
            return unquoted if isinstance(unquoted, str) else raw
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def _describe(err: Mapping[str, Any], model_cls: type[BaseModel], source: str) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        parent = _annotation_at(model_cls, [str(p) for p in err["loc"][:-1]], source)
        fields = {k for m in _unwrap(parent) if _is_model(m) for k in m.model_fields}
        expected = _expected_keys(str(err["loc"][-1]), fields) if fields else "no such key is allowed here"
        return f"{source}: unknown key {loc!r}; {expected}"
    if err["type"] == "missing":
        return f"{source}: {loc}: required key is missing"
    msg = err["msg"]
    msg = msg[0].lower() + msg[1:] if msg else msg
    if err["type"] == "value_error":  # a validator's own sentence says what is wrong and what is expected
        return f"{source}: {loc + ': ' if loc else ''}{msg.removeprefix('value error, ')}"
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    where = f"{loc}: " if loc else ""
    return f"{source}: {where}got {shown}; expected: {msg.removeprefix('input should be ')}"


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped); ConfigError naming the file and
    the line for a missing file or a line that is not JSON."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    out = []
    # lines end at "\n" only: str.splitlines() also splits at U+0085 and U+2028, which JSON leaves unescaped
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} line {n}: not JSON ({e.msg})") from None
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as a JSONL file, written whole (atomic_write_text)."""
    return atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
