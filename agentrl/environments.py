"""Stateful environments: a class of the user's own, one object of it per trajectory.

    tools:
      format: hermes
      environment:
        class: examples/envs/guess.py:GuessNumber    # a file, or package.module:Name
        params: {low: 1, high: 100}                  # keyword arguments of the class
        timeout_s: 10

For tasks whose tools share state within one trajectory and none across trajectories: a game, a database
the agent edits, a simulator. The class subclasses `Environment`: `reset(row)` starts its episode from the
dataset row, `step(action)` takes one tool call the format parsed and returns a `Step` (the observation
text, whether the episode is done, optionally a reward), `close()` releases what it holds. The methods
listed in its `tools` are what the model may call: each is shown with the schema of its signature and
docstring (as a function tool's is), and the base `step` validates the call's arguments and runs the method,
which returns a `Step` or the observation text. A class that wants every call may override `step` instead.

The rollout (rollout.py) makes one `Episode` per trajectory: it makes the object and resets it before the
first turn, sends each call to it or to the task's shared tools (the sandbox, the retriever, functions, MCP
servers: `ToolSet`, the environment every tool task has), and closes it when the trajectory ends, also on
errors and cancellation. A step that reports `done` ends the trajectory (stop reason `done`); its rewards
are kept in the trajectory's tool records, and the `environment` reward sums them (rewards/). Sync methods
run in a pool of threads (`threads`), async ones on the loop; a timeout counts from when the call starts.
What fails, and what follows:

- a call's arguments do not fit the method, or the method raises: an observation (`bad_arguments`,
  `tool_error`), the model goes on, as with any tool;
- `reset` raises, or a method outruns `timeout_s` (its state is unknown from then on): the trajectory is
  errored (`rollout/errored/environment`), left out of the loss and counted; the run goes on. Its last
  turn's records keep the calls that returned before the failing one, and that one with the error
  `environment`;
- `close` raises: logged; the trajectory keeps its result. `close` waits for a call still running in its
  thread (one past its timeout) to return, for up to `timeout_s`, and is not cut short by a cancellation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
import types
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agentrl.tools import Tool, call_tool
from agentrl.tools.functions import arguments_model, bad_arguments, function_schema, load_function
from agentrl.types import ToolCall, ToolResult

log = logging.getLogger("agentrl.environments")


@dataclass
class Step:
    """What one action did: the observation the model sees, whether the episode is over, and its reward."""

    observation: str
    done: bool = False
    reward: float | None = None


class Environment:
    """Base class of a task's environment: subclass it, list the methods the model may call in `tools`."""

    tools: tuple[str, ...] = ()

    def reset(self, row: dict[str, Any]) -> None:
        """Start an episode from the dataset row (all its fields)."""

    def step(self, action: ToolCall) -> Step | str:
        """Run the tool method `action` names with its arguments (validated against the method's signature)."""
        method = getattr(self, action.name)
        try:
            kwargs = arguments_model(method, action.name).model_validate(action.arguments).model_dump()
        except ValidationError as e:
            raise BadArguments(bad_arguments(action.name, e)) from None
        return method(**kwargs)

    def close(self) -> None:
        """Release what the episode holds."""


class BadArguments(ValueError):
    """A call whose arguments do not fit its method: the message is the model's observation."""


class EnvironmentFailed(Exception):
    """The environment failed in a way that leaves its episode unusable (the trajectory is errored).
    `completed`: the results of the turn's calls that returned before the one that failed, in order."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.completed: list[ToolResult] = []


def load_environment(ref: str) -> type[Environment]:
    """The class `ref` names; ValueError saying what is wrong (as `load_function`'s, or not an Environment,
    or a tool that is not a method of it)."""
    cls = load_function(ref)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{ref!r} is {cls!r}, not a subclass of agentrl.environments.Environment")
    if not cls.tools:
        raise ValueError(f"{ref!r}: its `tools` lists no method for the model to call")
    for name in cls.tools:
        if not callable(getattr(cls, name, None)):
            raise ValueError(f"{ref!r}: `tools` names {name!r}, which is not a method of {cls.__name__}")
    return cls


class Environments:
    """The task's environment class with its params: the tool names and schemas it shows the model, and a
    fresh object of it for each trajectory."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.cls = load_environment(spec.class_)
        self.names = tuple(self.cls.tools)
        self.timeout_s = spec.timeout_s
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def threads(self) -> concurrent.futures.ThreadPoolExecutor:
        """Where the sync methods run: a pool of the environments' own (a timeout counts from a call's start,
        so a call waiting here for a thread is not charged for the wait)."""
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.spec.threads, "agentrl-env")
        return self._threads

    @property
    def schemas(self) -> list[dict]:
        # A method bound to a bare object: the signature without `self`, the method's own docstring.
        return [function_schema(types.MethodType(getattr(self.cls, name), object()), name) for name in self.names]

    def new(self) -> Environment:
        return self.cls(**self.spec.params)


class ToolSet:
    """The task's shared, stateless tools as an environment: every call goes to its tool, nothing to reset."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float) -> None:
        self.tools, self.timeout_s = tools, timeout_s

    async def step(self, call: ToolCall) -> ToolResult:
        return await call_tool(call, self.tools, self.timeout_s)


class Episode:
    """One trajectory's environment: its own object of the task's environment class (if the task has one)
    for the calls that name its tools, the shared `ToolSet` for the rest."""

    def __init__(self, tools: ToolSet, environments: Environments | None) -> None:
        self.tools, self.environments = tools, environments
        self.env: Environment | None = None
        self._running: asyncio.Future | None = None  # the last sync call sent to a thread
        self._closed = False

    async def reset(self, row: dict[str, Any]) -> None:
        """Make and reset the trajectory's environment object; EnvironmentFailed when that fails."""
        if self.environments is None:
            return
        try:
            self.env = await self._run(self.environments.new)
            await self._run(self.env.reset, row)
        except EnvironmentFailed:
            raise
        except Exception as e:
            raise EnvironmentFailed(f"reset failed: {type(e).__name__}: {e}") from e

    async def step(self, call: ToolCall) -> tuple[ToolResult, bool]:
        """The call's result and whether the episode is done; EnvironmentFailed when the environment can no
        longer be trusted (it outran its timeout, or answered with something other than a Step or text)."""
        if self.env is None or call.name not in self.environments.names:
            return await self.tools.step(call), False
        t0 = time.perf_counter()
        try:
            value = await self._run(self.env.step, call)
        except EnvironmentFailed:
            raise
        except BadArguments as e:
            return ToolResult(str(e), error="bad_arguments", latency_s=time.perf_counter() - t0), False
        except Exception as e:  # the action failed, as a program's error does: the model sees why
            return ToolResult(f"Error: {type(e).__name__}: {e}", error="tool_error",
                              latency_s=time.perf_counter() - t0), False
        step = value if isinstance(value, Step) else Step(value) if isinstance(value, str) else None
        if step is None or not isinstance(step.observation, str):
            raise EnvironmentFailed(f"{call.name} returned {value!r:.80}; expected a Step or text")
        try:
            metadata = {} if step.reward is None else {"reward": float(step.reward)}
        except (TypeError, ValueError):
            raise EnvironmentFailed(f"{call.name} returned the reward {step.reward!r:.40}; expected a number") from None
        return ToolResult(step.observation, latency_s=time.perf_counter() - t0, metadata=metadata), bool(step.done)

    async def run(self, calls: list[ToolCall], given: dict[int, ToolResult]) -> tuple[list[ToolResult], bool]:
        """The results of one turn's `calls` (those in `given` already answered, by index) and whether the
        episode is done. Without an environment object the calls run together; with one, every call runs one
        after another in the model's order (the object's state is the trajectory's), up to the one that ends
        the episode."""
        async def one(i: int, call: ToolCall) -> tuple[ToolResult, bool]:
            return (given[i], False) if i in given else await self.step(call)

        if self.env is None:
            out = list(await asyncio.gather(*(one(i, c) for i, c in enumerate(calls))))
        else:
            out = []
            for i, call in enumerate(calls):
                try:
                    out.append(await one(i, call))
                except EnvironmentFailed as e:
                    e.completed = [r for r, _ in out]
                    raise
                if out[-1][1]:
                    break
        return [r for r, _ in out], any(done for _, done in out)

    async def close(self) -> None:
        """Close the environment object once, after the call it may still be running (one that outran its
        timeout, or the making of the object when the rollout was cancelled meanwhile) has returned or had
        `timeout_s` more; never cut short by a cancellation."""
        if self._closed:
            return
        self._closed = True
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        running, env, self.env = self._running, self.env, None
        if running is not None and not running.done():
            await asyncio.wait({running}, timeout=self.environments.timeout_s if self.environments else None)
        if (env is None and running is not None and running.done() and not running.cancelled()
                and running.exception() is None and isinstance(running.result(), Environment)):
            env = running.result()  # made while the trajectory was cancelled: closed all the same
        if env is None:
            return
        try:
            await self._run(env.close)
        except Exception as e:  # noqa: BLE001 - the trajectory is already whole; a failed cleanup is the env's
            log.warning("environment %s: close failed: %s: %s", type(env).__name__, type(e).__name__, e)

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` within the timeout, counted from when it starts: an async method on the loop, a sync
        one in the environments' threads. EnvironmentFailed when the timeout expires; an exception the method
        raises itself (a TimeoutError of its own included) is the method's."""
        timeout = self.environments.timeout_s
        name = getattr(fn, "__name__", repr(fn))
        if inspect.iscoroutinefunction(fn):
            call: Any = fn(*args)
        else:
            loop = asyncio.get_running_loop()
            started = asyncio.Event()

            def in_thread() -> Any:
                loop.call_soon_threadsafe(started.set)
                return fn(*args)

            future = self.environments.threads.submit(in_thread)
            self._running = asyncio.wrap_future(future)
            try:
                await started.wait()
            except asyncio.CancelledError:
                # Not started yet: it never will. Started (its start may not have reached the loop yet): it
                # runs on, and close waits for it; cancelling the awaitable instead would lose what it returns.
                future.cancel()
                raise
            call = asyncio.shield(self._running)  # a thread cannot be stopped: the wait for it can
        try:
            async with asyncio.timeout(timeout) as deadline:
                value = await call
                if inspect.isawaitable(value):  # the base step running an async tool method
                    value = await value
        except TimeoutError:
            if deadline.expired():
                raise EnvironmentFailed(f"{name} did not return within {timeout:g}s") from None
            raise
        return value
