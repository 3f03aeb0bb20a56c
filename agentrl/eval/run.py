"""`agentrl eval`: a model on benchmarks, through evaluate.py, with its outputs in one directory.

For each benchmark (datasets.py) the task spec's dataset is replaced by the benchmark's and its prompts
are rolled out `n` times each, in chunks; each finished chunk's records are appended to
`<out>/<benchmark>.samples.jsonl` (whole lines). A run started again with the same `--out` skips the
prompts whose samples are all there, and since every sample's seed is fixed by (seed, prompt, sample,
turn), resuming gives the results an uninterrupted run gives on a seeded engine. `results.json` and
`results.md` (also printed) are computed from the records alone. `--no-tools` runs the same prompts with
the tools off: no stop strings, one turn.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, atomic_write_text
from agentrl.eval.datasets import resolve
from agentrl.eval.evaluate import answer_format, evaluate, summarize
from agentrl.rewards import build_reward, close_reward, task_reward
from agentrl.run_dir import append_jsonl
from agentrl.task import Task
from agentrl.task_spec import Budgets, TaskSpec, ToolsSpec

CHUNK_PROMPTS = 64  # prompts per rollout call: a resumed run loses at most one chunk's work


def without_tools(spec: TaskSpec) -> TaskSpec:
    """The same task with the tools off: no tool format, one turn (ToRL's prompt text is kept as is)."""
    budgets = spec.budgets.model_dump() | {"max_turns": 1, "max_tool_calls": 0, "observation_max_chars": None,
                                           "max_calls_per_tool": {}}
    return spec.model_copy(update={"tools": ToolsSpec(), "budgets": Budgets(**budgets)})


async def run_eval(*, spec: TaskSpec, benchmarks: str, engine: Any, tokenizer: Any, out: Path, n: int,
                   temperature: float, seed: int = 0, data_dir: str | None = None, limit: int | None = None,
                   no_tools: bool = False, tool_urls: dict[str, str] | None = None,
                   progress: bool = True) -> dict[str, dict[str, float]]:
    from agentrl.tools import build_tools
    from agentrl.tools.formats import build_format

    if no_tools:
        spec = without_tools(spec)
    out.mkdir(parents=True, exist_ok=True)
    tools = build_tools({name: (tool_urls or {})[name] for name in spec.tools.names}, spec.tools.search_topk,
                        functions=spec.tools.functions, workers=spec.tools.workers, mcp=spec.tools.mcp)
    fmt = build_format(spec.tools.format, tokenizer=tokenizer, observation_max_chars=spec.budgets.observation_max_chars,
                       names=spec.tools.all_names)
    task = Task(spec, source="task")
    task.tool_schemas  # noqa: B018 - every tool checked now (a function standing in for a service too)
    environments = task.environments
    results: dict[str, dict[str, float]] = {}
    reward = task_reward(spec.reward, spec.tools.workers)
    try:
        task_format = answer_format(spec.reward.name)
        for bench, dataset in resolve(benchmarks, data_dir, limit, spec.dataset):
            if bench.name == "task":
                bench = dataclasses.replace(bench, kind="qa" if task_format == "answer-tag" else "math")
            if (bench.kind == "qa") != (task_format == "answer-tag"):
                raise ConfigError(f"--benchmarks {bench.name} is a {bench.kind} benchmark, and the task's reward "
                                  f"is {spec.reward.label!r}: pass a {bench.kind} task (e.g. tasks/"
                                  f"{'search_r1' if bench.kind == 'qa' else 'torl_math'}.yaml)")
            task = Task(spec.model_copy(update={"dataset": dataset}), source=f"--benchmarks {bench.name}")
            prompts = list(task.prompts(tokenizer))
            path = out / f"{bench.name}.samples.jsonl"
            records = _complete(path, n)
            todo = [p for p in prompts if p.id not in {r["prompt_id"] for r in records}]
            extra = build_reward("qa_f1", {}) if bench.kind == "qa" else None
            bar = _Bar(bench.name, len(prompts) * n, len(records)) if progress else None
            for i in range(0, len(todo), CHUNK_PROMPTS):
                result = await evaluate(todo[i:i + CHUNK_PROMPTS], engine=engine, fmt=fmt, tools=tools,
                                        budgets=spec.budgets, tokenizer=tokenizer, reward=reward, n=n,
                                        temperature=temperature, seed=seed, answer_format=task_format,
                                        extra=extra, on_done=bar.tick if bar else None, environments=environments)
                append_jsonl(path, [{"benchmark": bench.name, **r} for r in result.records])
                records += result.records
            if bar:
                bar.close()
            order = {p.id: i for i, p in enumerate(prompts)}
            records.sort(key=lambda r: (order.get(r["prompt_id"], len(order)), r["sample"]))
            results[bench.name] = summarize(records, n)
    finally:
        try:
            for tool in tools.values():
                await tool.aclose()
        finally:
            close_reward(reward)
    config = {"benchmarks": benchmarks, "n": n, "temperature": temperature, "seed": seed, "no_tools": no_tools,
              "limit": limit, "task": spec.model_dump(mode="json")}
    atomic_write_text(out / "results.json", json.dumps({"config": config, "results": results}, indent=1) + "\n")
    atomic_write_text(out / "results.md", markdown_table(results, n))
    return results


def _complete(path: Path, n: int) -> list[dict[str, Any]]:
    """The records of the prompts whose n samples are all in `path` (a partial prompt is redone)."""
    if not path.exists():
        return []
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().split("\n"):  # not splitlines(): see config.read_jsonl
        if line.strip():
            r = json.loads(line)
            by_prompt.setdefault(str(r["prompt_id"]), []).append(r)
    return [r for rs in by_prompt.values() if sorted(r["sample"] for r in rs) == list(range(n)) for r in rs]


def markdown_table(results: dict[str, dict[str, float]], n: int) -> str:
    cols = ["pass@1", *(f"pass@{n}",) * (n > 1), *(f"maj@{n}",) * (n > 1), "tool_call_rate", "turns", "response_tokens"]
    if any("f1" in m for m in results.values()):
        cols.insert(1, "f1")
    lines = ["| benchmark | prompts | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, m in results.items():
        cells = [f"{m.get(c, float('nan')):.3f}" if c not in ("turns", "response_tokens") else f"{m[c]:.1f}"
                 for c in cols]
        lines.append(f"| {name} | {int(m['prompts'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class _Bar:
    def __init__(self, name: str, total: int, done: int) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn(name), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                 TimeRemainingColumn())
        self.progress.start()
        self.task = self.progress.add_task(name, total=total, completed=done)

    def tick(self) -> None:
        self.progress.advance(self.task)

    def close(self) -> None:
        self.progress.stop()
