"""The spine of types every stage passes along (DESIGN.md, "One spine of types").

task.py makes `Prompt`s; tools/ turn a `ToolCall` into a `ToolResult`; rewards/ return a `RewardResult`.
The rollout types (segments, trajectories, stop reasons) join them here as the rollout lands.
No torch here: the services and the CLI import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One dataset row rendered for the model: the exact text and token ids it will see."""

    id: str
    text: str
    token_ids: tuple[int, ...]
    question: str
    ground_truth: Any  # str | list[str]: one or several acceptable answers
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCall:
    """A call parsed from the model's output. `raw` is the model text it was parsed from."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What a tool answered. A failure is still a result (invariant 4): `error` names its kind
    ("timeout", "http_503", "connection", "malformed", ...) and `text` is what the model sees."""

    text: str
    error: str | None = None
    latency_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RewardResult:
    """A scalar reward plus named sub-scores (logged as `reward/<name>`)."""

    score: float
    parts: dict[str, float] = field(default_factory=dict)
