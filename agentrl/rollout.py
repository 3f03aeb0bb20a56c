"""The agent loop: prompts in, `Trajectory`s out, each within the task's budgets (task.Budgets).

A `TrajectoryBuilder` is the state machine of one trajectory: it asks for a model turn with the token
budget left, takes the engine's `Completion` (kept as a model segment, ids and logprobs exactly as
sampled), decodes those ids (never the engine's text) and lets the task's tool format (tools/formats.py)
decide: run tools, show an invalid-action message, or stop with exactly one `StopReason`. Each trajectory's
calls go to its own `Episode` (environments.py): the object of the task's environment class for the tools
it defines, reset before the first turn and closed after the last (in `turn_sync` mode, when the whole
rollout ends), and the shared tools (tools/) for the
rest; a call past its tool's own budget is answered without running. Results are rendered, tokenized on
their own and appended as a masked tool segment. A failed tool is an observation, never an exception. Every model turn, however it ended, is also judged void or not by the
format (SimpleTIR's void turn, `ToolFormat.is_void`); the trajectory carries the count in `timings`, which
`algo.drop_void_turns` reads (batch.py).

Two drivers run builders: `mode="async"` gives each trajectory its own asyncio task, so one trajectory's
tool call overlaps the others' generation; `mode="turn_sync"` runs every trajectory's turn k together,
then every tool call of turn k (the ToRL / Search-R1 / TRL loop), kept as a baseline for bench/.
Rewards, advantages and packing come after this stage (rewards/, algo/, learner/).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import Field

from agentrl.config import StrictModel
from agentrl.engine import Completion, Engine, Sampling, completed_stop
from agentrl.environments import EnvironmentFailed, Environments, Episode, ToolSet
from agentrl.task_spec import Budgets
from agentrl.tools import Tool
from agentrl.tools.formats import Answer, Calls, Invalid, ToolFormat
from agentrl.types import Group, Prompt, Segment, StopReason, ToolCall, ToolRecord, ToolResult, Trajectory

T = TypeVar("T")

log = logging.getLogger("agentrl.rollout")


class RolloutConfig(StrictModel):
    n: int = Field(default=8, ge=1)  # samples per prompt
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int = 0
    mode: Literal["async", "turn_sync"] = "async"
    tool_timeout_s: float = Field(default=60.0, gt=0)  # a last resort: tools have their own timeouts


class TrajectoryBuilder:
    def __init__(self, prompt: Prompt, sample: int, fmt: ToolFormat, budgets: Budgets, tokenizer: Any, seed: int = 0):
        self.prompt, self.sample, self.fmt, self.budgets, self.tokenizer = prompt, sample, fmt, budgets, tokenizer
        self.key = f"{prompt.id}/{sample}"
        self.ids = list(prompt.token_ids)
        self.segments: list[Segment] = []
        self.records: list[ToolRecord] = []
        self.stop: StopReason | None = None
        self.turn = 0
        self.tool_calls = 0
        self.calls_by_tool: Counter[str] = Counter()
        self.error: str | None = None
        self.invalid_turns = 0
        self.void_turns = 0
        self.timings = {"generate_s": 0.0, "tool_s": 0.0}
        self._seed = seed
        self._turn_limit = StopReason.RESPONSE_BUDGET
        self._turn_text = ""

    @property
    def response_len(self) -> int:
        return len(self.ids) - len(self.prompt.token_ids)

    def _room(self) -> tuple[int, int]:
        b = self.budgets
        context = b.max_context_tokens - len(self.ids) if b.max_context_tokens else 1 << 62
        return b.max_response_tokens - self.response_len, context

    def next_sampling(self, base: Sampling) -> Sampling | None:
        """The sampling of the next model turn, or None (with the stop reason set) when none is left."""
        if self.stop is not None:
            return None
        response, context = self._room()
        if context <= 0:
            self.stop = StopReason.CONTEXT_LIMIT
        elif response <= 0:
            self.stop = StopReason.RESPONSE_BUDGET
        if self.stop is not None:
            return None
        limits = [(response, StopReason.RESPONSE_BUDGET), (context, StopReason.CONTEXT_LIMIT)]
        if self.budgets.max_tokens_per_turn:
            limits.append((self.budgets.max_tokens_per_turn, StopReason.TURN_LENGTH))
        max_tokens, self._turn_limit = min(limits, key=lambda x: x[0])
        # A seed per (run, prompt, sample, turn): reproducible, yet not the same draws every turn.
        seed = zlib.crc32(f"{self._seed}/{self.key}/{self.turn}".encode())
        return base.with_(max_tokens=max_tokens, stop=self.fmt.stop, seed=seed)

    def add_completion(self, c: Completion) -> Calls | Invalid | None:
        """Record a model turn; return what must run before the next turn, or None."""
        self.turn += 1
        start = 0
        for count, version in c.versions or [(len(c.token_ids), None)]:  # a run per policy version (partial rollout)
            self.segments.append(Segment("model", list(c.token_ids[start : start + count]),
                                         list(c.logprobs[start : start + count]), version))
            start += count
        self.ids.extend(c.token_ids)
        text = self._turn_text = self.tokenizer.decode(c.token_ids)  # what the model wrote: render reads its end
        # Judged before any cut or stop: a turn cut by a length limit is void too when it holds neither.
        self.void_turns += self.fmt.is_void(text)
        stop = completed_stop(self.tokenizer, c.token_ids, self.fmt.stop)
        if stop is not None:  # parse up to the stop string; the last token may run past it
            text = text[: text.rfind(stop) + len(stop)]
        elif c.finish_reason == "length":
            self.stop = self._turn_limit
            return None
        action = self.fmt.parse(text, stop)
        if action is None:
            self.stop = StopReason.EOS
        elif isinstance(action, Answer):
            self.stop = StopReason.ANSWERED
        elif self.turn >= self.budgets.max_turns:
            self.stop = StopReason.MAX_TURNS
        elif isinstance(action, Calls) and self.tool_calls + len(action.calls) > self.budgets.max_tool_calls:
            self.stop = StopReason.MAX_TOOL_CALLS
        else:
            return action
        return None

    def refusals(self, calls: Sequence[ToolCall]) -> dict[int, ToolResult]:
        """Count `calls` against their tools' own budgets (`budgets.max_calls_per_tool`); those past it are
        answered here, by index, without running."""
        refused = {}
        for i, call in enumerate(calls):
            self.calls_by_tool[call.name] += 1
            limit = self.budgets.max_calls_per_tool.get(call.name)
            if limit is not None and self.calls_by_tool[call.name] > limit:
                refused[i] = ToolResult(f"Error: the {call.name} tool takes at most {limit} calls in this task, "
                                        "and they are spent", error="budget")
        return refused

    def fail(self, kind: str, message: str) -> None:
        """End the trajectory as errored (`kind`): it cannot go on, and it is not the model's doing."""
        log.warning("trajectory %s: %s failed: %s", self.key, kind, message)
        self.stop, self.error = StopReason.ERRORED, kind

    def add_observation(self, action: Calls | Invalid, results: Sequence[ToolResult], done: bool = False) -> None:
        """Record what the tools answered (`results`: one per call run, in order) and append the rendered
        observation; `done`: the environment ended the episode, which ends the trajectory unappended."""
        if isinstance(action, Calls):
            calls = self._record(action, results)  # calls after the one that ended the episode did not run
            if done:
                self.stop = StopReason.DONE
                return
            obs_ids = self._fitted(calls, list(results))
        else:  # the format's parse-error policy (tools/formats.py): an invalid turn is a failed call too
            self.invalid_turns += 1
            self.records.append(ToolRecord(self.turn, None, ToolResult(action.message, error="malformed")))
            obs_ids = self._encode(self.fmt.render_invalid(action, self._turn_text))
        response, context = self._room()
        # An observation that leaves the model no room to answer ends the trajectory unappended.
        if context - len(obs_ids) < 1:
            self.stop = StopReason.CONTEXT_LIMIT
        elif response - len(obs_ids) < 1:
            self.stop = StopReason.RESPONSE_BUDGET
        else:
            self.segments.append(Segment("tool", obs_ids))
            self.ids.extend(obs_ids)

    def add_failed_turn(self, action: Calls, completed: Sequence[ToolResult], failure: ToolResult) -> None:
        """Record a turn whose environment failed: the calls that returned before the failing one, then that
        one with `failure` (the trajectory is errored, so no observation follows)."""
        self._record(action, [*completed, failure])

    def _record(self, action: Calls, results: Sequence[ToolResult]) -> list[ToolCall]:
        """Keep the turn's calls that ran, one per result, in order; returns them."""
        calls = action.calls[: len(results)]
        self.tool_calls += len(calls)
        self.records += [ToolRecord(self.turn, c, r) for c, r in zip(calls, results, strict=True)]
        return calls

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _fitted(self, calls: list[ToolCall], results: list[ToolResult]) -> list[int]:
        """The rendered observation's ids within `observation_max_tokens`: the tools' outputs are cut (each
        to an equal share of what the format's own text leaves), never the format's text, which for Hermes
        ends with the template's assistant header. Cut text is re-tokenized, so a merge at the cut can leave
        it a token over; the format's text alone may exceed a tiny budget."""
        obs_ids = self._encode(self.fmt.render(calls, results, self._turn_text))
        limit = self.budgets.observation_max_tokens
        if not limit or len(obs_ids) <= limit:
            return obs_ids
        bare = [dataclasses.replace(r, text="") for r in results]
        share = max(0, limit - len(self._encode(self.fmt.render(calls, bare, self._turn_text)))) // len(results)
        cut = [dataclasses.replace(r, text=self.tokenizer.decode(self._encode(r.text)[:share])) for r in results]
        return self._encode(self.fmt.render(calls, cut, self._turn_text))

    def finish(self) -> Trajectory:
        assert self.stop is not None, "finish() before the trajectory stopped"
        timings = dict(self.timings, turns=float(self.turn), invalid_turns=float(self.invalid_turns),
                       void_turns=float(self.void_turns))
        error = self.error or ("tool" if any(r.result.service_fault for r in self.records) else None)
        return Trajectory(self.prompt, self.segments, self.stop, self.sample, self.records, timings=timings,
                          error=error)


async def _run_tools(b: TrajectoryBuilder, action: Calls | Invalid, episode: Episode) -> None:
    t0 = time.perf_counter()
    results: list[ToolResult] = []
    done = False
    if isinstance(action, Calls):
        try:
            results, done = await episode.run(action.calls, b.refusals(action.calls))
        except EnvironmentFailed as e:
            b.fail("environment", str(e))
            b.add_failed_turn(action, e.completed, ToolResult(str(e), error="environment"))
            return
    b.timings["tool_s"] += time.perf_counter() - t0
    b.add_observation(action, results, done)


async def _generate(b: TrajectoryBuilder, engine: Engine, sampling: Sampling) -> Calls | Invalid | None:
    t0 = time.perf_counter()
    completion = await engine.generate(b.ids, sampling, session=b.key)
    b.timings["generate_s"] += time.perf_counter() - t0
    return b.add_completion(completion)


async def _reset(b: TrajectoryBuilder, episode: Episode) -> None:
    try:
        # A copy per trajectory: the samples of a group share the prompt, and an environment may keep its row.
        await episode.reset(copy.deepcopy(b.prompt.metadata.get("row", {})))
    except EnvironmentFailed as e:
        b.fail("environment", str(e))


async def _run_async(b: TrajectoryBuilder, engine: Engine, episode: Episode, base: Sampling,
                     on_done: Callable[[], None] | None = None) -> None:
    try:
        await _reset(b, episode)
        while (sampling := b.next_sampling(base)) is not None:
            action = await _generate(b, engine, sampling)
            if action is not None:
                await _run_tools(b, action, episode)
    finally:  # also when the rollout is cancelled or failed
        await episode.close()
    if on_done is not None:
        on_done()


async def _run_turn_sync(builders: list[TrajectoryBuilder], engine: Engine, episodes: list[Episode],
                         base: Sampling) -> None:
    try:
        await _all(_reset(b, e) for b, e in zip(builders, episodes, strict=True))
        while True:
            turn = [(b, e, s) for b, e in zip(builders, episodes, strict=True)
                    if (s := b.next_sampling(base)) is not None]
            if not turn:
                return
            actions = await _all(_generate(b, engine, s) for b, _, s in turn)
            await _all(_run_tools(b, a, e) for (b, e, _), a in zip(turn, actions, strict=True) if a)
    finally:
        await asyncio.gather(*(e.close() for e in episodes), return_exceptions=True)


async def _all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `coros` together; the first failure cancels the others before it reaches the caller (raised as
    itself), so no trajectory keeps generating or calling tools after a rollout has failed, e.g. into
    weights the trainer is about to change. (asyncio.gather would leave them running.)"""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            if not t.cancelling():  # one request each: a second would cut short a task's own cleanup
                t.cancel()  # (gather has made one already where the caller was cancelled)
        await asyncio.gather(*tasks, return_exceptions=True)  # until every one has stopped
        raise


async def rollout(prompts: Sequence[Prompt], *, engine: Engine, fmt: ToolFormat, tools: dict[str, Tool],
                  budgets: Budgets, tokenizer: Any, config: RolloutConfig,
                  on_done: Callable[[], None] | None = None, priority: int = 0,
                  environments: Environments | None = None) -> list[Group]:
    """`config.n` trajectories for every prompt, grouped by prompt, in prompt order, each with its own
    `Episode` over the shared `tools` (and an object of the task's `environments` class, where it has one).
    The engine's context window, where it declares one, caps `budgets.max_context_tokens`. `on_done` is
    called as each trajectory ends (a progress bar's tick). Every request carries `priority`."""
    window = getattr(engine, "max_context_tokens", None)
    if window and (budgets.max_context_tokens is None or window < budgets.max_context_tokens):
        budgets = budgets.model_copy(update={"max_context_tokens": window})
    base = Sampling(max_tokens=1, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                    priority=priority)
    builders = [TrajectoryBuilder(p, k, fmt, budgets, tokenizer, config.seed) for p in prompts for k in range(config.n)]
    shared = ToolSet(tools, config.tool_timeout_s)
    episodes = [Episode(shared, environments) for _ in builders]
    if config.mode == "async":
        await _all(_run_async(b, engine, e, base, on_done) for b, e in zip(builders, episodes, strict=True))
    else:
        await _run_turn_sync(builders, engine, episodes, base)
        for _ in builders if on_done is not None else ():
            on_done()
    trajectories = [b.finish() for b in builders]
    return [Group(p, trajectories[i * config.n : (i + 1) * config.n]) for i, p in enumerate(prompts)]


# --- what a rollout reports ---------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    n = max(1, len(trajectories))
    lengths = [len(t.response_ids) for t in trajectories]
    stops = Counter(t.stop_reason for t in trajectories)
    records = [r for t in trajectories for r in t.tool_records]
    latencies = [r.result.latency_s * 1000 for r in records]
    metrics = {
        "rollout/response_length/mean": sum(lengths) / n,
        "rollout/response_length/max": float(max(lengths, default=0)),
        "rollout/turns/mean": sum(t.num_turns for t in trajectories) / n,
        "rollout/invalid_turns/mean": sum(t.timings.get("invalid_turns", 0.0) for t in trajectories) / n,
        "rollout/void_turns/mean": sum(t.timings.get("void_turns", 0.0) for t in trajectories) / n,
        "tool/calls_per_trajectory": len(records) / n,
        "tool/error_rate": sum(not r.result.ok for r in records) / max(1, len(records)),
        "tool/latency_ms/p50": _percentile(latencies, 0.5),
        "tool/latency_ms/p99": _percentile(latencies, 0.99),
    }
    metrics.update({f"rollout/stop/{reason.value}": stops[reason] / n for reason in StopReason})
    kinds = Counter(r.result.error for r in records if r.result.error is not None)  # each failure kind's share
    metrics.update({f"tool/errors/{kind}": count / max(1, len(records)) for kind, count in kinds.items()})
    errored = Counter(t.error for t in trajectories if t.error is not None)
    metrics["rollout/errored"] = sum(errored.values()) / n
    metrics.update({f"rollout/errored/{kind}": count / n for kind, count in errored.items()})
    return metrics


class ErroredSteps:
    """The fault policy across steps: a step whose share of errored trajectories is above `max_frac` is a
    warning; `max_steps` such steps in a row stop the run, naming the kinds. Errored trajectories are left
    out of the loss (batch.py); a step with nothing else trains on nothing."""

    def __init__(self, max_frac: float, max_steps: int) -> None:
        self.max_frac, self.max_steps, self.in_a_row = max_frac, max_steps, 0

    def check(self, groups: Sequence[Group], step: int) -> bool:
        """Whether the step's `groups` leave any trajectory to train on (raises past the limit)."""
        trajectories = [t for g in groups for t in g.trajectories]
        errored = Counter(t.error for t in trajectories if t.error is not None)
        share = sum(errored.values()) / max(1, len(trajectories))
        if share <= self.max_frac:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        message = (f"step {step}: {share:.0%} of the step's trajectories are errored ("
                   + ", ".join(f"{kind}: {count}" for kind, count in errored.most_common())
                   + f"; trainer.max_errored_frac is {self.max_frac:g})")
        if self.in_a_row >= self.max_steps:
            raise RuntimeError(f"{message}, {self.in_a_row} steps in a row (trainer.max_errored_steps): the run stops")
        log.warning(message)
        return share < 1
