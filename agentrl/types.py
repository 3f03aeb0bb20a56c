"""The spine of types every stage passes along.

task.py makes `Prompt`s; rollout.py turns each into `Trajectory`s (prompt ids followed by `Segment`s of
model-sampled or tool-observation tokens, one `StopReason`); tools/ turn a `ToolCall` into a
`ToolResult`; rewards/ return a `RewardResult`; the learner packs trajectories into tensors using
`Trajectory.loss_mask`, the one place the mask is built.
No torch here: the services and the CLI import this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal


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


# Error kinds that mean the tool's service failed, not the model's call: no answer in time, unreachable,
# an unreadable or failed answer, a client that raised, and HTTP statuses a well-formed call does not
# cause (a server error, refused credentials, a wrong URL, throttling). The model's own failures (a program
# that fails or outruns its time limit, a malformed or oversized call) are not among them.
SERVICE_FAULTS = frozenset({"no_answer", "connection", "bad_response", "sandbox_error", "exception",
                            "http_401", "http_403", "http_404", "http_408", "http_429"})


@dataclass(frozen=True)
class ToolResult:
    """What a tool answered. A failure is still a result, never an exception: `error` names its kind
    ("timeout": the program's own time limit; "no_answer", "http_503", "connection", "malformed", ...) and
    `text` is what the model sees."""

    text: str
    error: str | None = None
    latency_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def service_fault(self) -> bool:
        """The service failed (SERVICE_FAULTS, or any 5xx): the trajectory is errored, not the model wrong."""
        return self.error is not None and (self.error in SERVICE_FAULTS or self.error.startswith("http_5"))


@dataclass(frozen=True)
class RewardResult:
    """A scalar reward plus named sub-scores (logged as `reward/<name>`)."""

    score: float
    parts: dict[str, float] = field(default_factory=dict)


class StopReason(str, enum.Enum):
    """Why a trajectory ended; exactly one per trajectory."""

    ANSWERED = "answered"  # the tool format saw a final answer (e.g. </answer>)
    EOS = "eos"  # the model ended its turn without a tool call
    MAX_TURNS = "max_turns"  # it called a tool on its last allowed turn
    MAX_TOOL_CALLS = "max_tool_calls"  # it called a tool once more than allowed
    TURN_LENGTH = "turn_length"  # one turn reached budgets.max_tokens_per_turn without stopping
    RESPONSE_BUDGET = "response_budget"  # the response reached budgets.max_response_tokens
    CONTEXT_LIMIT = "context_limit"  # prompt + response reached budgets.max_context_tokens
    DONE = "done"  # the task's environment ended the episode (environments.py)
    ERRORED = "errored"  # it could not go on: its environment failed (the trajectory is errored)


@dataclass
class Segment:
    """A run of response tokens from one source. `model` segments hold exactly the ids the engine
    sampled, with their logprobs; `tool` segments hold the ids of a tokenized observation."""

    source: Literal["model", "tool"]
    token_ids: list[int]
    logprobs: list[float] | None = None  # model segments: one per token
    version: int | None = None  # model segments: the policy version (weight updates so far) that sampled them

    def __post_init__(self) -> None:
        if self.source == "model" and (self.logprobs is None or len(self.logprobs) != len(self.token_ids)):
            raise ValueError("a model segment needs one logprob per token")


@dataclass
class ToolRecord:
    """One tool call of a trajectory, for metrics and dumps."""

    turn: int
    call: ToolCall | None  # None: the model's call could not be parsed
    result: ToolResult


@dataclass
class Trajectory:
    """Prompt ids followed by segments. `response_ids` is what the model saw after the prompt, in order;
    `loss_mask` marks the tokens the model sampled."""

    prompt: Prompt
    segments: list[Segment]
    stop_reason: StopReason
    sample: int = 0  # index within its group (n samples per prompt)
    tool_records: list[ToolRecord] = field(default_factory=list)
    reward: RewardResult | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # Why the trajectory is errored (its fault, not the model's), or None. "tool": a tool's service failed
    # after its retries. An errored trajectory is left out of the loss and counted (rollout/errored/<kind>).
    error: str | None = None
    # What the learner made of it, where the step computed it (batch.py): "advantage" (the mean over its
    # trained tokens) and "logprobs" (the learner's of each response token before the step). For the dumps.
    learner: dict[str, Any] = field(default_factory=dict)

    @property
    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 on model-sampled tokens, 0 on tool-observation tokens; the prompt is not part of it."""
        return [1 if s.source == "model" else 0 for s in self.segments for _ in s.token_ids]

    @property
    def response_logprobs(self) -> list[float]:
        """The engine's logprob of each response token; 0.0 on tool tokens (masked out anyway)."""
        return [lp for s in self.segments for lp in (s.logprobs if s.source == "model" else [0.0] * len(s.token_ids))]

    @property
    def num_turns(self) -> int:
        """Model turns: runs of model segments (a turn sampled across a weight update is two segments)."""
        return sum(1 for i, s in enumerate(self.segments)
                   if s.source == "model" and (i == 0 or self.segments[i - 1].source != "model"))

    @property
    def versions(self) -> list[int]:
        """The policy versions that sampled its model segments, in order (those that carry one)."""
        return [s.version for s in self.segments if s.source == "model" and s.version is not None]


@dataclass
class Group:
    """The n trajectories sampled for one prompt; group-relative advantages are computed over it."""

    prompt: Prompt
    trajectories: list[Trajectory]
