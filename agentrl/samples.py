"""What a step leaves for people to read: its trajectories as JSON records, segment by segment, with the
per-token arrays the viewer shades (agentrl/view/), dumped to `samples/step_N.jsonl` in whole groups.

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
    lines = "".join(json.dumps(trajectory_record(t, tokenizer), ensure_ascii=False) + "\n" for t in trajectories)
    return atomic_write_text(Path(path), lines)
