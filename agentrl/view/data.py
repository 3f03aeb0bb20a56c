"""What the viewer reads: run dirs of `agentrl train` and out dirs of `agentrl eval`, as they are on disk.

A training run has `metrics.jsonl` (one line a step) and `samples/step_N.jsonl` (samples.py's records); an
eval dir has `results.json` and one `<benchmark>.samples.jsonl` each, shown as the run's "steps", one per
benchmark. Either may still be being written: every read looks at the files as they are now, so the steps
of a run in training appear as they land, and a half-written last line is left for the next read.

A step's file can be large (512 samples of long trajectories), so a page never takes it whole: `index()`
gives each sample's summary (samples.py: reward, stop reason, tool use, staleness, its first words) and
where its line starts, from the index the trainer wrote beside the step (or, where there is none, an eval
dir's, by reading each line once), and `trajectory()` reads that one line. Summaries are kept per file
until the file changes (its size or modification time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError
from agentrl.samples import index_path, newest_version, summary


@dataclass
class _Index:
    stamp: tuple[int, int]
    rows: list[dict[str, Any]]
    offsets: list[int]


class Run:
    """One run dir or eval dir; `name` is how the page shows it."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name
        self.kind = "eval" if (path / "results.json").exists() or list(path.glob("*.samples.jsonl")) else "train"
        if self.kind == "train" and not (path / "metrics.jsonl").exists() and not (path / "samples").is_dir():
            raise ConfigError(f"{path}: neither a run dir of agentrl train (metrics.jsonl, samples/) nor an out dir "
                              "of agentrl eval (results.json, <benchmark>.samples.jsonl)")
        self._indexes: dict[Path, _Index] = {}

    def _files(self) -> dict[str, Path]:
        if self.kind == "eval":
            return {p.name.removesuffix(".samples.jsonl"): p for p in sorted(self.path.glob("*.samples.jsonl"))}
        found = {int(p.stem.removeprefix("step_")): p for p in (self.path / "samples").glob("step_*.jsonl")
                 if p.stem.removeprefix("step_").isdigit()}
        return {str(k): found[k] for k in sorted(found)}

    def metrics(self) -> list[dict[str, Any]]:
        """The metrics lines logged so far (an eval dir: one line per benchmark from results.json)."""
        if self.kind == "eval":
            path = self.path / "results.json"
            results = json.loads(path.read_text())["results"] if path.exists() else {}
            return [{"step": name, **values} for name, values in results.items()]
        return _lines(self.path / "metrics.jsonl")[0]

    def steps(self) -> list[dict[str, Any]]:
        """Each step with samples: its name and headline metrics."""
        by_step = {str(m.get("step")): m for m in self.metrics()}
        keys = ("reward/mean", "val/pass@1", "pass@1", "rollout/response_length/mean", "tool/calls_per_trajectory",
                "tool_call_rate")
        return [{"step": name, **{k: by_step[name][k] for k in keys if k in by_step.get(name, {})}}
                for name in self._files()]

    def index(self, step: str) -> list[dict[str, Any]]:
        return self._index(step).rows

    def _index(self, step: str) -> _Index:
        path = self._files().get(step)
        if path is None:
            raise KeyError(f"{self.name}: no samples for step {step!r}")
        stat = path.stat()
        stamp = (stat.st_size, stat.st_mtime_ns)
        cached = self._indexes.get(path)
        if cached is None or cached.stamp != stamp:
            cached = self._written_index(path, stamp)
            if cached is None:  # no index beside it, or one of an older file: read the samples themselves
                records, offsets = _lines(path)
                newest = newest_version(records)
                cached = _Index(stamp, [summary(i, r, newest) for i, r in enumerate(records)], offsets)
            self._indexes[path] = cached
        return cached

    @staticmethod
    def _written_index(path: Path, stamp: tuple[int, int]) -> _Index | None:
        """The index the trainer wrote beside a step's samples (samples.py), where it is of the file as it is."""
        written = index_path(path)
        if not written.exists():
            return None
        index = json.loads(written.read_text(encoding="utf-8"))
        fits = [index.get("size"), index.get("mtime_ns")] == list(stamp)
        return _Index(stamp, index["rows"], index["offsets"]) if fits else None

    def trajectory(self, step: str, i: int) -> dict[str, Any]:
        index = self._index(step)
        if not 0 <= i < len(index.rows):
            raise KeyError(f"{self.name}: step {step} has no sample {i}")
        with self._files()[step].open("rb") as f:
            f.seek(index.offsets[i])
            record = json.loads(f.readline())
        return {**index.rows[i], "record": record}

    def prompt_across_steps(self, prompt_id: str) -> list[dict[str, Any]]:
        """Every sample of `prompt_id` in every step: step, index, sample, reward."""
        return [{"step": step, **row} for step in self._files() for row in self.index(step)
                if row["prompt_id"] == prompt_id]


def _lines(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The whole JSON lines of `path` and where each starts; a last line still being written is left out."""
    records, offsets, at = [], [], 0
    if not path.exists():
        return records, offsets
    with path.open("rb") as f:
        for line in f:
            if line.endswith(b"\n") and line.strip():
                records.append(json.loads(line))
                offsets.append(at)
            at += len(line)
    return records, offsets


def open_runs(paths: list[Path]) -> list[Run]:
    """The runs at `paths`, named by their directory (with the parent's name where two would clash, and a
    number where that still does); names are single URL path segments."""
    full = [p.resolve() for p in paths]
    names = [p.name or "root" for p in full]
    names = [f"{p.parent.name}-{n}" if names.count(n) > 1 else n for p, n in zip(full, names, strict=True)]
    names = [f"{n}-{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return [Run(p, n) for p, n in zip(full, names, strict=True)]
