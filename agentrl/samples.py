"""What a step leaves for people to read: its trajectories as JSON records, segment by segment, with the
per-token arrays the viewer shades (agentrl/view/), dumped to `samples/step_N.jsonl` in whole groups, with
a small index beside it (`step_N.index.json`: each sample's summary and where its line starts).

A record's `segments` carry each segment's source (model: trained on; tool: masked), text, token ids, each
token's text, and for model segments the engine's logprob of each token, the policy version that sampled
it and the learner's logprobs where the step computed them (batch.py). `agentrl sft` reads the same records
back as training traces (sft.py); `agentrl eval` writes its samples with the same segments (eval/).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.config import atomic_write_text
from agentrl.types import Group, Trajectory


def segment_records(t: Trajectory, tokenizer: Any) -> list[dict[str, Any]]:
    """Each segment of `t` as the viewer (agentrl/view/) and the SFT reader take it: its source, text and
    token ids, each token's text (`pieces`), and for a model segment the engine's logprob of each token, its
    policy version, and the learner's logprobs where the step computed them. The loss mask is the source:
    model tokens are trained on, tool tokens are not."""
    learner = t.learner.get("logprobs")
    out, start = [], 0
    for s in t.segments:
        ids = list(s.token_ids)
        record: dict[str, Any] = {"source": s.source, "text": tokenizer.decode(ids), "tokens": len(ids), "ids": ids,
                                  "pieces": tokenizer.batch_decode([[i] for i in ids])}
        if s.source == "model":
            record["logprobs"] = [round(lp, 5) for lp in s.logprobs]
            if learner is not None:
                record["learner_logprobs"] = [round(lp, 5) for lp in learner[start:start + len(ids)]]
        if s.version is not None:
            record["version"] = s.version
        out.append(record)
        start += len(ids)
    return out


def tool_call_records(t: Trajectory) -> list[dict[str, Any]]:
    return [{"turn": r.turn, "name": r.call.name if r.call else None,
             "arguments": r.call.arguments if r.call else None, "error": r.result.error,
             "latency_ms": round(r.result.latency_s * 1000, 3)}
            | ({"reward": r.result.metadata["reward"]} if "reward" in r.result.metadata else {})
            for r in t.tool_records]


def trajectory_record(t: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """A JSON-able view of a trajectory for dumps: texts decoded from the ids, segment by segment, with the
    per-token arrays of `segment_records`; `id` is its group's (the prompt's)."""
    return {
        "id": t.prompt.id,
        "sample": t.sample,
        "stop_reason": t.stop_reason.value,
        "reward": None if t.reward is None else {"score": t.reward.score, **t.reward.parts},
        "error": t.error,
        "advantage": t.learner.get("advantage"),
        "prompt": t.prompt.text,
        "segments": segment_records(t, tokenizer),
        "tool_calls": tool_call_records(t),
        "ground_truth": t.prompt.ground_truth,
        "timings": t.timings,
    }


def whole_groups(groups: Sequence[Group], at_least: int) -> list[Trajectory]:
    """The trajectories of the fewest leading groups that hold at least `at_least` of them."""
    out: list[Trajectory] = []
    for g in groups:
        if len(out) >= at_least:
            break
        out += g.trajectories
    return out


def dump_trajectories(path: str | Path, trajectories: Sequence[Trajectory], tokenizer: Any) -> Path:
    """The records of `trajectories` to `path` (JSON lines), and beside it their index (`index_path`)."""
    records = [trajectory_record(t, tokenizer) for t in trajectories]
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in records]
    atomic_write_text(Path(path), "".join(lines))
    offsets, at = [], 0
    for line in lines:
        offsets.append(at)
        at += len(line.encode())
    write_index(Path(path), records, offsets)
    return Path(path)


def index_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".index.json")


def write_index(path: Path, records: Sequence[dict[str, Any]], offsets: Sequence[int]) -> None:
    """What the viewer lists of a step without reading its samples (agentrl/view/data.py): each record's
    `summary` and where its line starts, for the file at `path` as it is (its size and time say so)."""
    newest = newest_version(records)
    stat = path.stat()
    index = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "offsets": list(offsets),
             "rows": [summary(i, r, newest) for i, r in enumerate(records)]}
    atomic_write_text(index_path(path), json.dumps(index, ensure_ascii=False))


def newest_version(records: Sequence[dict[str, Any]]) -> int:
    return max((s.get("version", -1) for r in records for s in r["segments"]), default=-1)


def summary(i: int, r: dict[str, Any], newest_version: int) -> dict[str, Any]:
    """What a list of samples and its filters need of record `r` (a training dump's or an eval sample's):
    reward, stop reason, tool use and errors, staleness (the step's newest policy version less the oldest
    that sampled it), the model's first words, and the text a search looks in (prompt, model and tool text,
    its first 8,000 characters: the index stays small)."""
    reward = r.get("reward")
    score = reward.get("score") if isinstance(reward, dict) else r.get("score")
    calls = r.get("tool_calls") if isinstance(r.get("tool_calls"), list) else r.get("calls", [])
    versions = [s["version"] for s in r["segments"] if "version" in s]
    text = "".join(s["text"] for s in r["segments"] if s["source"] == "model")
    everything = r.get("prompt", "") + "".join(s["text"] for s in r["segments"])
    return {
        "i": i, "prompt_id": str(r.get("id", r.get("prompt_id"))), "sample": r.get("sample", 0), "score": score,
        "stop_reason": r.get("stop_reason"), "tool_calls": len(calls),
        "tool_error": any(c.get("error") for c in calls), "error": r.get("error"),
        "staleness": newest_version - min(versions) if versions and newest_version >= 0 else 0,
        "newest_version": newest_version,
        "advantage": r.get("advantage"), "tokens": sum(s.get("tokens", 0) for s in r["segments"]),
        "snippet": text[:160], "text": everything[:8_000].lower(),
    }
