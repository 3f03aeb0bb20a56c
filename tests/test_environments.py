"""environments.py through the rollout: one environment object per trajectory, reset from its row, its
methods the tools; done, rewards, and every failure (bad arguments, a raise, a timeout, a failed reset, a
cancelled rollout), each with the object closed at the end."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.config import ConfigError
from agentrl.environments import Environment, Environments, Step
from agentrl.rewards import build_reward
from agentrl.rollout import RolloutConfig, rollout
from agentrl.task import Task, load_task
from agentrl.task_spec import Budgets, EnvironmentSpec
from agentrl.tools.formats import HermesFormat
from agentrl.types import Prompt, StopReason
from tests.conftest import REPO
from tests.test_rollout import EOS, ScriptedEngine

BUDGETS = Budgets(max_turns=6, max_tool_calls=5, max_response_tokens=600)


class Counter(Environment):
    """Counts up from the row's `start`; every object records what happened to it, for the test to read."""

    tools = ("add", "stop", "boom", "hang", "wrong", "own_timeout", "bad_reward", "work")
    made: list[Counter] = []

    def __init__(self, fail_reset: bool = False) -> None:
        self.fail_reset, self.events = fail_reset, []
        self.release = threading.Event()  # set by close: ends a method blocked past its timeout
        Counter.made.append(self)

    def reset(self, row):
        if self.fail_reset:
            raise RuntimeError("no such board")
        self.total = row["start"]
        self.events.append(("reset", row["start"]))

    def add(self, n: int) -> str:
        """Add n to the total.

        Args:
            n: how much to add.
        """
        self.total += n
        return f"total {self.total}"

    async def stop(self) -> Step:
        """End the episode, rewarded by the total."""
        return Step(f"final {self.total}", done=True, reward=float(self.total))

    def boom(self) -> str:
        """Fail."""
        raise ValueError("the board is on fire")

    def hang(self) -> str:
        """Never return in time."""
        self.release.wait(30)
        return "late"

    def wrong(self) -> int:
        """Return the wrong type."""
        return 3

    def own_timeout(self) -> str:
        """Raise a TimeoutError of its own (a socket's, say)."""
        raise TimeoutError("the board's server timed out")

    def bad_reward(self) -> Step:
        """Reward with something that is not a number."""
        return Step("ok", reward="good")  # type: ignore[arg-type]

    def work(self) -> str:
        """Take a while, as a simulator's step does."""
        time.sleep(0.3)  # the environment's own work: the test is about how long it waits for a thread
        return "worked"

    def close(self):
        self.events.append(("close",))
        self.release.set()


def call(name, **arguments):
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>{EOS}'


@pytest.fixture
def envs():
    Counter.made.clear()

    def make(threads=16, **params):
        return Environments(EnvironmentSpec.model_validate({"class": "tests.test_environments:Counter", "params": params,
                                                            "timeout_s": 0.5, "threads": threads}))
    return make


def go(tok, envs, scripts, n=1, mode="async", threads=16, **params):
    environments = envs(threads, **params)
    fmt = HermesFormat(tok, environments.schemas)
    prompts = [Prompt(pid, "Q", tuple(tok.encode("Q")), "Q", "0", {"row": {"start": 10 * i}})
               for i, pid in enumerate(scripts)]
    groups = asyncio.run(rollout(prompts, engine=ScriptedEngine(tok, scripts), fmt=fmt, tools={}, budgets=BUDGETS,
                                 tokenizer=tok, config=RolloutConfig(n=n, mode=mode), environments=environments))
    return [t for g in groups for t in g.trajectories]


@pytest.mark.parametrize("mode", ["async", "turn_sync"])
def test_one_object_per_trajectory_reset_from_its_row_and_closed(qwen_tokenizer, envs, mode):
    scripts = {"a": [call("add", n=1), call("add", n=2), call("stop")], "b": [call("add", n=5), call("stop")]}
    trajectories = go(qwen_tokenizer, envs, scripts, n=2, mode=mode)
    assert len(Counter.made) == 4  # 2 prompts x 2 samples, each its own object
    starts = sorted(e.events[0][1] for e in Counter.made)
    assert starts == [0, 0, 10, 10] and all(e.events[-1] == ("close",) for e in Counter.made)
    reward = build_reward("environment")
    for t in trajectories:
        expected = 3 if t.prompt.id == "a" else 15  # its own total: no state shared across trajectories
        assert t.stop_reason == StopReason.DONE and t.error is None
        assert t.tool_records[-1].result.text == f"final {expected}"
        assert t.segments[-1].source == "model"  # the episode ended: no observation after the last turn
        assert reward("", "0", tool_records=t.tool_records).score == expected


def test_failures_are_observations_or_errored_trajectories(qwen_tokenizer, envs):
    scripts = {"raise": [call("boom"), call("add", n="many"), call("nope"), call("stop")],
               "late": [call("hang"), call("stop")], "wrong": [call("wrong"), call("stop")]}
    by_id = {t.prompt.id: t for t in go(qwen_tokenizer, envs, scripts)}
    t = by_id["raise"]  # the model's bad actions: observations, and it goes on to the end
    assert [r.result.error for r in t.tool_records] == ["tool_error", "bad_arguments", "unknown_tool", None]
    assert "the board is on fire" in t.tool_records[0].result.text and "n:" in t.tool_records[1].result.text
    assert t.stop_reason == StopReason.DONE and t.error is None
    for pid in ("late", "wrong"):  # the environment's own faults: errored, out of the loss
        assert by_id[pid].stop_reason == StopReason.ERRORED and by_id[pid].error == "environment"
        assert by_id[pid].num_turns == 1
    assert all(e.events[-1] == ("close",) for e in Counter.made)


def test_a_turn_whose_environment_fails_keeps_the_calls_that_returned_before(qwen_tokenizer, envs):
    two = call("add", n=1).removesuffix(EOS) + call("wrong")  # one turn, two calls: the second fails
    [t] = go(qwen_tokenizer, envs, {"p": [two, call("stop")]})
    assert t.stop_reason == StopReason.ERRORED and t.error == "environment" and t.num_turns == 1
    assert [(r.call.name, r.result.error) for r in t.tool_records] == [("add", None), ("wrong", "environment")]
    assert t.tool_records[0].result.text == "total 1" and "expected a Step or text" in t.tool_records[1].result.text


def test_a_methods_own_timeout_is_its_error_and_a_reward_not_a_number_errors_only_its_trajectory(qwen_tokenizer, envs):
    scripts = {"own": [call("own_timeout"), call("stop")], "bad": [call("bad_reward"), call("stop")],
               "fine": [call("add", n=1), call("stop")]}
    by_id = {t.prompt.id: t for t in go(qwen_tokenizer, envs, scripts)}
    own = by_id["own"]
    assert own.tool_records[0].result.error == "tool_error" and "timed out" in own.tool_records[0].result.text
    assert own.stop_reason == StopReason.DONE and own.error is None
    assert by_id["bad"].error == "environment" and by_id["fine"].stop_reason == StopReason.DONE


def test_a_call_waiting_for_a_thread_is_not_charged_for_the_wait(qwen_tokenizer, envs):
    """Four trajectories, one thread: each step takes 0.3 s of the 0.5 s allowed, the last waits 0.9 s for
    the thread, and none is errored: the timeout counts from a call's start."""
    scripts = {f"p{i}": [call("work"), call("stop")] for i in range(4)}
    trajectories = go(qwen_tokenizer, envs, scripts, threads=1)
    assert [t.error for t in trajectories] == [None] * 4
    assert all(t.tool_records[0].result.text == "worked" for t in trajectories)


def test_a_failed_reset_errors_the_trajectory_before_any_turn(qwen_tokenizer, envs):
    (t,) = go(qwen_tokenizer, envs, {"a": [call("stop")]}, fail_reset=True)
    assert t.stop_reason == StopReason.ERRORED and t.error == "environment" and t.segments == []


def test_a_cancelled_rollout_closes_every_environment(qwen_tokenizer, envs):
    environments = envs()
    stepped = asyncio.Event()

    class Stalls(ScriptedEngine):
        async def generate(self, prompt_ids, sampling, *, session=None):
            if self.turns[session] == 1:
                stepped.set()
                await asyncio.Event().wait()  # the second turn never comes back
            return await super().generate(prompt_ids, sampling, session=session)

    async def main():
        prompt = Prompt("a", "Q", tuple(qwen_tokenizer.encode("Q")), "Q", "0", {"row": {"start": 1}})
        task = asyncio.create_task(rollout(
            [prompt], engine=Stalls(qwen_tokenizer, {"a": [call("add", n=1), call("stop")]}),
            fmt=HermesFormat(qwen_tokenizer, environments.schemas), tools={}, budgets=BUDGETS,
            tokenizer=qwen_tokenizer, config=RolloutConfig(n=3), environments=environments))
        await stepped.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert len(Counter.made) == 3 and all(e.events[-1] == ("close",) for e in Counter.made)


def test_the_environment_reward_sums_the_steps_rewards(qwen_tokenizer, envs):
    (t,) = go(qwen_tokenizer, envs, {"a": [call("add", n=4), call("stop")]})
    result = build_reward("environment")("", "0", tool_records=t.tool_records)
    assert (result.score, result.parts) == (4.0, {"rewarded_steps": 1.0})


@pytest.mark.parametrize(("ref", "message"), [
    ("examples/envs/nope.py:X", "no file"),
    ("examples/envs/guess.py:Nope", "has no 'Nope'"),
    ("examples/tools/units.py:convert", "not a subclass of agentrl.environments.Environment"),
])
def test_bad_environment_classes_are_config_errors_naming_the_key(monkeypatch, ref, message):
    monkeypatch.chdir(REPO)
    task = load_task("examples/guess.yaml", [f"tools.environment.class={ref}"])
    with pytest.raises(ConfigError, match=rf"tools\.environment\.class: .*{message}"):
        task.tool_schemas  # noqa: B018


def test_tools_naming_no_method_and_a_format_other_than_hermes_are_errors(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    (tmp_path / "env.py").write_text("from agentrl.environments import Environment\n"
                                     "class E(Environment):\n    tools = ('fly',)\n")
    task = load_task("examples/guess.yaml", [f"tools.environment.class={tmp_path}/env.py:E"])
    with pytest.raises(ConfigError, match="`tools` names 'fly', which is not a method of E"):
        task.tool_schemas  # noqa: B018
    with pytest.raises(ConfigError, match="environment tools need format hermes"):
        load_task("examples/guess.yaml", ["tools.format=torl", "tools.names=[python]"])


def test_the_guess_example_plays_a_game_to_its_end(monkeypatch, qwen_tokenizer):
    monkeypatch.chdir(REPO)
    valid = CliRunner().invoke(app, ["tasks", "validate", "examples/guess.yaml"])
    assert valid.exit_code == 0 and "hermes ['guess']" in valid.output, valid.output
    checked = CliRunner().invoke(app, ["tasks", "check", "examples/guess.yaml", "--field", "answer"])
    assert checked.exit_code != 0 and "grades no text" in checked.output
    task = load_task("examples/guess.yaml")
    row = next(r for r in task.rows() if r.fields["high"] >= 50)
    prompt = task.render(row, qwen_tokenizer)
    secret = row.fields["secret"]
    low = secret - 1 if secret > 1 else secret + 1
    scripts = {prompt.id: [call("guess", number=low), call("guess", number=secret), "unused" + EOS]}
    groups = asyncio.run(rollout([prompt], engine=ScriptedEngine(qwen_tokenizer, scripts),
                                 fmt=HermesFormat(qwen_tokenizer, task.tool_schemas), tools={},
                                 budgets=task.spec.budgets, tokenizer=qwen_tokenizer, config=RolloutConfig(n=1),
                                 environments=task.environments))
    (t,) = groups[0].trajectories
    first, second = (r.result.text for r in t.tool_records)
    assert first == f"The number is {'higher' if low < secret else 'lower'} than {low}."
    assert second == f"{secret} is right, found in 2 guesses." and t.stop_reason == StopReason.DONE
    assert build_reward("environment")("", "", tool_records=t.tool_records).score == 1.0
    assert isinstance(Task(task.spec).environments, Environments)
