"""Evaluation through the same rollout loop, tool format and reward as training: the trainer's validation
and `agentrl eval`.

`evaluate` samples `n` trajectories per prompt, scores them on the text the model wrote (rewards.score)
and returns one `sample_record` per trajectory; `summarize` turns records into metrics: pass@1 (the mean
correctness), the unbiased pass@k of Chen et al. (2021) for every k <= n, maj@k, the tool-call rate, turns,
response length and stop-reason fractions. Metrics are computed from the records alone, so a run resumed
from the records it wrote reports what an uninterrupted one would.

maj@k: the first k samples of a prompt vote with their extracted answers (normalised: the math reward's
`normalize_answer`, or SQuAD's normalisation for `<answer>` tags); a sample without an answer does not
vote. The answer with the most votes wins; a tie goes to the answer given first (by sample index), so the
result is deterministic. The prompt counts as correct when the winning answer's first sample was graded
correct; with no votes at all it counts as wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from math import comb
from typing import Any

from agentrl.rewards import Reward, model_text, score
from agentrl.rollout import RolloutConfig, rollout
from agentrl.samples import segment_records, tool_call_records
from agentrl.task_spec import Budgets
from agentrl.tools import Tool
from agentrl.tools.formats import ToolFormat
from agentrl.types import Prompt, StopReason, Trajectory


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n (`correct` of them
    right) is right: 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= correct <= n, got n={n}, correct={correct}, k={k}")
    return 1.0 - comb(n - correct, k) / comb(n, k)


def majority_correct(answers: Sequence[str | None], verdicts: Sequence[bool]) -> bool:
    """maj@k over these samples: see the module docstring for the vote and its tie rule."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)  # the first given among the tied
    return bool(verdicts[answers.index(winner)])


def answer_format(reward_name: str | None) -> str:
    """How a task's reward reads the final answer: `answer-tag` (the QA rewards) or `boxed` (math)."""
    return "answer-tag" if reward_name in ("qa_em", "qa_f1") else "boxed"


def extract_answer(response: str, answer_format: str) -> str | None:
    """The response's final answer, normalised for voting: `boxed` (math) or `answer-tag` (QA)."""
    if answer_format == "boxed":
        from agentrl.rewards.math import extract_boxed, normalize_answer

        found = extract_boxed(response)
        return normalize_answer(found) or None if found is not None else None
    from agentrl.rewards.qa import extract_answer as answer_tag
    from agentrl.rewards.qa import normalize_text

    found = answer_tag(response)
    return normalize_text(found) or None if found is not None else None


def sample_record(t: Trajectory, tokenizer: Any, answer_format: str, extra: Reward | None = None) -> dict[str, Any]:
    """One evaluated trajectory: what the model wrote and saw (segments marked model / tool), its answer
    and verdict, and what the rollout counted."""
    text = model_text(t, tokenizer)
    assert t.reward is not None
    record = {
        "prompt_id": t.prompt.id, "sample": t.sample, "answer": extract_answer(text, answer_format),
        "correct": bool(t.reward.parts.get("correct", t.reward.score > 0)), "score": t.reward.score,
        "stop_reason": t.stop_reason.value, "turns": t.num_turns, "tool_calls": len(t.tool_records),
        "tool_errors": sum(not r.result.ok for r in t.tool_records), "response_tokens": len(t.response_ids),
        "ground_truth": t.prompt.ground_truth, "prompt": t.prompt.text,
        "segments": segment_records(t, tokenizer), "calls": tool_call_records(t),
    }
    if extra is not None:  # QA: token F1 beside exact match
        record["f1"] = extra(text, t.prompt.ground_truth).score
    return record


def summarize(records: Sequence[dict[str, Any]], n: int, prefix: str = "") -> dict[str, float]:
    """Metrics of records of `n` samples per prompt (a prompt with fewer records is an error)."""
    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_prompt.setdefault(str(r["prompt_id"]), []).append(r)
    for pid, rs in by_prompt.items():
        if sorted(r["sample"] for r in rs) != list(range(n)):
            raise ValueError(f"prompt {pid}: samples {sorted(r['sample'] for r in rs)}, expected 0..{n - 1}")
        rs.sort(key=lambda r: r["sample"])
    groups = list(by_prompt.values())
    count = max(len(records), 1)
    m: dict[str, float] = {"prompts": float(len(groups)), "samples": float(len(records))}
    m["pass@1"] = sum(r["correct"] for r in records) / count
    for k in range(1, n + 1):
        m[f"pass@{k}"] = sum(pass_at_k(n, sum(r["correct"] for r in g), k) for g in groups) / max(len(groups), 1)
        m[f"maj@{k}"] = sum(majority_correct([r["answer"] for r in g[:k]], [r["correct"] for r in g[:k]])
                            for g in groups) / max(len(groups), 1)
    m["score"] = sum(r["score"] for r in records) / count
    if records and "f1" in records[0]:
        m["f1"] = sum(r["f1"] for r in records) / count
    m["tool_call_rate"] = sum(r["tool_calls"] > 0 for r in records) / count
    m["tool_calls"] = sum(r["tool_calls"] for r in records) / count
    m["tool_error_rate"] = sum(r["tool_errors"] for r in records) / max(sum(r["tool_calls"] for r in records), 1)
    m["turns"] = sum(r["turns"] for r in records) / count
    m["response_tokens"] = sum(r["response_tokens"] for r in records) / count
    stops = Counter(r["stop_reason"] for r in records)
    m |= {f"stop/{s.value}": stops[s.value] / count for s in StopReason}
    return {prefix + k: v for k, v in m.items()}


@dataclass
class EvalResult:
    metrics: dict[str, float]
    records: list[dict[str, Any]]


async def evaluate(prompts: Sequence[Prompt], *, engine: Any, fmt: ToolFormat, tools: dict[str, Tool],
                   budgets: Budgets, tokenizer: Any, reward: Reward, n: int = 1, temperature: float = 0.0,
                   seed: int = 0, answer_format: str = "boxed", extra: Reward | None = None, prefix: str = "val/",
                   on_done: Any = None, environments: Any = None) -> EvalResult:
    """`n` trajectories per prompt (greedy at temperature 0), scored, as records and their metrics;
    `environments`: the task's environment class (environments.py), if it has one."""
    config = RolloutConfig(n=n, temperature=temperature, seed=seed)
    groups = await rollout(prompts, engine=engine, fmt=fmt, tools=tools, budgets=budgets, tokenizer=tokenizer,
                           config=config, on_done=on_done, environments=environments)
    trajectories = [t for g in groups for t in g.trajectories]
    await score(trajectories, reward, tokenizer)
    records = [sample_record(t, tokenizer, answer_format, extra) for t in trajectories]
    return EvalResult(summarize(records, n, prefix) if records else {}, records)
