"""Python functions as tools: a task spec names a function, the model calls it by name.

    tools:
      format: hermes
      functions:
        - function: examples/tools/units.py:convert     # a file (relative to the working directory) ...
        - function: mypackage.tools:lookup               # ... or an importable module
          timeout_s: 5

The model sees the function's JSON schema (in the system prompt, through the chat template): its name, the
first paragraph of its docstring, and one property per parameter, typed by the annotation and described
by the docstring's `Args:` entry; a spec may give `description` and `parameters` (a JSON schema) instead,
which must then name exactly the function's parameters. Before a call runs, its arguments are validated
against the signature; a bad call is an observation naming what was wrong (`bad_arguments`).

Calls run in a pool of worker processes (function_pool.py), sync and async functions alike, so a slow or
CPU-heavy tool never blocks the rollout's loop, and a call past its `timeout_s` is ended by killing its
worker (`timeout`). What the model sees: the returned string, or any other JSON value as JSON. An
exception raised by the function is an observation too (`tool_error`: the model's call failed, as a
program's error is); a return value that is not JSON, or a worker that died, is the tool's own fault
(`bad_response`, `exception`): the trajectory is errored (agentrl/types.py SERVICE_FAULTS).

The functions are the user's own code: they run with the trainer's rights, outside the sandbox.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from agentrl.types import ToolCall, ToolResult


def load_function(ref: str) -> Callable[..., Any]:
    """The function `ref` names: "path/to/file.py:name" or "package.module:name". A ValueError says what
    is wrong (no such file, a failed import, no such name, not callable)."""
    module_ref, sep, name = ref.rpartition(":")
    if not sep or not module_ref or not name:
        raise ValueError(f"{ref!r}: expected 'path/to/file.py:name' or 'package.module:name'")
    try:
        if module_ref.endswith(".py"):
            path = Path(module_ref).resolve()
            if not path.is_file():
                raise ValueError(f"{ref!r}: no file {path}")
            module_name = f"agentrl_user_{abs(hash(str(path)))}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[module_name]
                    raise
        else:
            module = importlib.import_module(module_ref)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{ref!r}: importing {module_ref} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{ref!r}: {module_ref} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"{ref!r}: {name} is a {type(fn).__name__}, not a function")
    return fn


_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The first paragraph of `fn`'s docstring, and each parameter's text from its `Args:` section (Google
    style: `name: text` or `name (type): text`, continued on deeper-indented lines)."""
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    lines = doc.splitlines()
    stripped = [line.strip() for line in lines]
    params: dict[str, str] = {}
    if "Args:" not in stripped:
        return summary, params
    indent, current = None, None
    for line in lines[stripped.index("Args:") + 1:]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the next section
            break
        match = _ARG_LINE.match(line)
        if match and (indent is None or depth == indent):
            indent, current = depth, match.group(1)
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] += " " + line.strip()
    return summary, params


def arguments_model(fn: Callable[..., Any], name: str) -> type[BaseModel]:
    """A pydantic model of `fn`'s parameters (annotations, defaults; no others accepted)."""
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: *{p.name} parameters cannot be described to the model; "
                             "name each parameter")
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        fields[p.name] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
    return create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)


def _strip_titles(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


def function_schema(fn: Callable[..., Any], name: str, description: str | None = None,
                    parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI-style function schema the chat template renders: from the signature and docstring, or
    the `description` and `parameters` given, which must name exactly the function's parameters."""
    summary, docs = _docstring_parts(fn)
    model = arguments_model(fn, name)
    if parameters is None:
        parameters = _strip_titles(model.model_json_schema())
        for key, text in docs.items():
            if key in parameters.get("properties", {}) and text:
                parameters["properties"][key].setdefault("description", text)
    else:
        given = set(parameters.get("properties", {}))
        if parameters.get("type") != "object" or given != set(model.model_fields):
            raise ValueError(f"tool {name!r}: parameters must be a JSON schema of type object whose properties "
                             f"are the function's parameters {sorted(model.model_fields)}; got {sorted(given)}")
        required = {k for k, f in model.model_fields.items() if f.is_required()}
        if set(parameters.get("required", [])) != required:
            raise ValueError(f"tool {name!r}: parameters.required must be {sorted(required)} (the parameters "
                             f"without a default); got {sorted(parameters.get('required', []))}")
    return {"type": "function", "function": {"name": name, "description": description or summary,
                                             "parameters": parameters}}


def bad_arguments(name: str, e: ValidationError) -> str:
    """The observation for a call to tool `name` whose arguments did not validate: each problem by its key."""
    problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors())
    return f"Error: bad arguments for {name}: {problems}"


def observation(value: Any) -> str:
    """What the model sees of a returned value: a string as it is, any other JSON value as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)  # TypeError/ValueError: not JSON (the caller reports it)


class FunctionTool:
    """One function of the spec as a Tool: arguments validated here, the call run by the pool."""

    def __init__(self, name: str, ref: str, fn: Callable[..., Any], pool: Any, timeout_s: float) -> None:
        self.name, self.ref, self.pool, self.timeout_s = name, ref, pool, timeout_s
        self.arguments = arguments_model(fn, name)

    async def call(self, call: ToolCall) -> ToolResult:
        start = time.perf_counter()
        try:
            kwargs = self.arguments.model_validate(call.arguments).model_dump()
        except ValidationError as e:
            return ToolResult(bad_arguments(self.name, e), error="bad_arguments", latency_s=time.perf_counter() - start)
        result = await self.pool.call(self.ref, kwargs, self.timeout_s)
        return ToolResult(result.text, result.error, latency_s=time.perf_counter() - start, metadata=result.metadata)

    async def aclose(self) -> None:
        """Ends the pool's workers (the pool is shared by the task's function tools; closing it twice is fine)."""
        self.pool.close()
