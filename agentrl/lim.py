"""LIMR's Learning Impact Measurement (`agentrl lim`): which training prompts' learning follows the run's.

For prompt i and epoch k, r_i^k is the fraction of its samples answered correctly in that epoch (the
trainer's `prompt_stats.jsonl`, or an external reward log). rbar^k is the mean of r_i^k over the prompts
kept, and the score is

    s_i = 1 - sum_k (r_i^k - rbar^k)^2 / sum_k (1 - rbar^k)^2

so a prompt whose accuracy rises as the run's does scores near 1, and one always solved or never solved
scores low. As LIMR computes it: a prompt missing from an epoch takes its value from the next epoch, in one
pass from the first epoch to the last (so of two missing epochs in a row only the later is filled); a
prompt still missing an epoch after that, the last one included, is dropped, and never-seen prompts with
it. Selection keeps the prompts scoring at least the threshold (LIMR: 0.6), and RAND is a seeded random
subset of the same size, drawn from every scored prompt, for the baseline run.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError


def epoch_accuracies(records: Iterable[dict[str, Any]], source: str) -> dict[str, dict[int, float]]:
    """`{prompt_id: {epoch: accuracy}}` from records with `prompt_id`, `epoch` and `correct` in [0, 1];
    several records of one prompt and epoch are averaged, weighted by their `n` (samples) where given."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for i, r in enumerate(records, 1):
        try:
            pid, epoch, correct = str(r["prompt_id"]), int(r["epoch"]), float(r["correct"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{source} record {i}: {e!r}; expected "
                              '{"prompt_id": str, "epoch": int, "correct": float in [0, 1]}') from None
        if not 0.0 <= correct <= 1.0:
            raise ConfigError(f"{source} record {i}: correct={correct} is outside [0, 1] (a fraction of samples "
                              "answered correctly, not a raw reward)")
        weight = float(r.get("n", 1) or 1)
        acc = sums[pid][epoch]
        acc[0] += weight * correct
        acc[1] += weight
    return {pid: {k: s / w for k, (s, w) in by_epoch.items()} for pid, by_epoch in sums.items()}


def lim_scores(accuracies: dict[str, dict[int, float]]) -> dict[str, float]:
    """LIM score of every prompt kept (see the module docstring), by prompt id."""
    if not accuracies:
        raise ConfigError("no prompt accuracies to score")
    epochs = range(min(min(a) for a in accuracies.values()), max(max(a) for a in accuracies.values()) + 1)
    sequences: dict[str, list[float]] = {}
    for pid, by_epoch in accuracies.items():
        seq: list[float | None] = [by_epoch.get(k) for k in epochs]
        for j in range(len(seq) - 1):  # one pass forward: a gap takes the next epoch's value
            if seq[j] is None and seq[j + 1] is not None:
                seq[j] = seq[j + 1]
        if None not in seq:
            sequences[pid] = seq  # type: ignore[assignment]
    if not sequences:
        raise ConfigError(f"no prompt was seen in every epoch {epochs.start}-{epochs.stop - 1} (after filling "
                          "gaps from the next epoch): nothing to score")
    mean = [sum(s[j] for s in sequences.values()) / len(sequences) for j in range(len(epochs))]
    worst = sum((1.0 - m) ** 2 for m in mean)
    if worst == 0.0:
        raise ConfigError("every prompt kept was answered correctly in every epoch: the LIM score is undefined")
    return {pid: 1.0 - sum((r - m) ** 2 for r, m in zip(s, mean, strict=True)) / worst for pid, s in sequences.items()}


def select(scores: dict[str, float], threshold: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """The prompts scoring at least `threshold`, and a seeded RAND subset of the same size (ids in order
    of the scores' keys)."""
    chosen = [pid for pid, s in scores.items() if s >= threshold]
    rand = sorted(random.Random(seed).sample(sorted(scores), len(chosen)), key=list(scores).index)
    return chosen, rand


def histogram(scores: Iterable[float], bins: int = 10, width: int = 40) -> str:
    """A text histogram of scores: equal-width bins from the lowest score to 1."""
    values = sorted(scores)
    low = min(values[0], 0.0)
    step = (1.0 - low) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(int((v - low) / step), bins - 1)] += 1
    top = max(counts) or 1
    return "\n".join(f"[{low + i * step:6.2f}, {low + (i + 1) * step:5.2f}{']' if i == bins - 1 else ')'} "
                     f"{c:7d} {'#' * round(width * c / top)}" for i, c in enumerate(counts))


def run_rows(run_dir: Path) -> list[Any]:
    """The training rows of the run in `run_dir` (its resolved config's task), in dataset order."""
    from agentrl.config import read_yaml, validate
    from agentrl.run_config import RunConfig
    from agentrl.task import Task

    config = validate(RunConfig, read_yaml(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    return Task(config.task, source=f"{run_dir}/config.yaml: task").rows()

