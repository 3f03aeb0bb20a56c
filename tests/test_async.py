"""Asynchronous training: the versioned engine (engine/versioned.py) tags every token with the policy version
that sampled it and lets a weight update in only at a token boundary, keeping what was sampled (partial
rollouts); the trainer's asynchronous loop drops, and counts, groups past the staleness bound, and with
`max_staleness: 0` trains on exactly the synchronous trainer's batches."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.engine import Completion, Sampling
from agentrl.engine.versioned import VersionedEngine
from agentrl.rollout import TrajectoryBuilder
from agentrl.task import load_tokenizer
from agentrl.types import Prompt
from tests.conftest import REPO
from tests.test_trainer import CODE_TURN, ScriptedEngine, config, read_jsonl


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(REPO / "configs/tiny_tokenizer"))


class WeightsEngine:
    """Token i of a sequence is 5 + i % 50 and its logprob -(w + 1), w the weights it holds: what was sampled
    by which weights shows in the output. `hold` keeps the first request waiting until released."""

    max_context_tokens = None

    def __init__(self) -> None:
        self.weights, self.in_flight, self.in_flight_at_update = 0, 0, []
        self.hold: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def generate(self, prompt_ids, sampling: Sampling, *, session=None) -> Completion:
        self.in_flight += 1
        try:
            self.started.set()
            if self.hold is not None:
                hold, self.hold = self.hold, None
                await hold.wait()
            ids = [5 + (len(prompt_ids) + i) % 50 for i in range(sampling.max_tokens)]
            return Completion(ids, [-(self.weights + 1.0)] * len(ids), "length")
        finally:
            self.in_flight -= 1

    async def push(self) -> str:
        self.in_flight_at_update.append(self.in_flight)
        self.weights += 1
        return "pushed"


def test_a_weight_update_mid_generation_waits_for_a_token_boundary_and_keeps_what_was_sampled():
    async def main():
        inner = WeightsEngine()
        inner.hold = hold = asyncio.Event()
        engine = VersionedEngine(inner, tokenizer=None, chunk_tokens=4)
        generating = asyncio.create_task(engine.generate([1, 2, 3], Sampling(max_tokens=12)))
        await inner.started.wait()  # the first request (4 tokens) is in flight
        updating = asyncio.create_task(engine.update(inner.push, version=7))
        hold.set()  # the update ran only once that request had returned: in_flight_at_update says so
        return await generating, await updating, inner, engine

    c, pushed, inner, engine = asyncio.run(main())
    assert pushed == "pushed" and inner.in_flight_at_update == [0] and engine.version == 7
    assert c.versions == [(4, 0), (8, 7)]  # 4 tokens by the old weights, the rest by the new
    assert c.token_ids == [5 + (3 + i) % 50 for i in range(12)]  # continued from the kept ids
    assert c.logprobs == [-1.0] * 4 + [-2.0] * 8 and c.finish_reason == "length"
    assert engine.stats["paused_requests"] == 1 and engine.last_drain["requests"] == 1


def test_an_engine_out_of_context_ends_the_completion_instead_of_being_asked_again():
    class Full(WeightsEngine):
        async def generate(self, prompt_ids, sampling, *, session=None):
            self.calls = getattr(self, "calls", 0) + 1
            return Completion([9, 9], [-1.0, -1.0], "length")  # fewer than asked: its window is full

    inner = Full()
    c = asyncio.run(VersionedEngine(inner, tokenizer=None, chunk_tokens=4).generate([1], Sampling(max_tokens=12)))
    assert (c.token_ids, c.finish_reason, c.versions, inner.calls) == ([9, 9], "length", [(2, 0)], 1)


def test_the_trajectory_carries_each_version_on_its_own_segment(tok):
    from agentrl.task_spec import Budgets
    from agentrl.tools.formats import build_format

    b = TrajectoryBuilder(Prompt("p", "q", (1, 2, 3), "", ""), 0, build_format("torl", tokenizer=tok),
                          Budgets(max_response_tokens=64), tok)
    b.add_completion(Completion([7, 8, 9, 10, 11], [-1.0] * 5, "stop", None, versions=[(2, 3), (3, 4)]))
    t = b.finish()
    assert [(s.source, s.token_ids, s.version) for s in t.segments] == [("model", [7, 8], 3), ("model", [9, 10, 11], 4)]
    assert t.versions == [3, 4] and t.num_turns == 1 and t.loss_mask == [1] * 5


class TextEngine:
    """Emits `text`'s tokens in order, whatever the prompt: like vLLM, it sees stop strings only in its own
    output, so one that spans two requests is for the versioned engine to find."""

    max_context_tokens = None

    def __init__(self, tok, text: str, start: int) -> None:
        self.tok, self.ids, self.start = tok, tok.encode(text, add_special_tokens=False), start

    async def generate(self, prompt_ids, sampling: Sampling, *, session=None) -> Completion:
        done = len(prompt_ids) - self.start
        ids = self.ids[done : done + sampling.max_tokens]
        for j in range(1, len(ids) + 1):
            stop = next((s for s in sampling.stop if s in self.tok.decode(ids[:j])), None)
            if stop is not None:
                return Completion(ids[:j], [-1.0] * j, "stop", stop)
        return Completion(ids, [-1.0] * len(ids), "length")


def test_a_stop_string_spanning_two_requests_ends_the_completion_where_it_completes(tok):
    text = "print(42)\n```\n```output and then more text that must not be kept"
    ids = tok.encode(text, add_special_tokens=False)
    whole = next(j for j in range(1, len(ids) + 1) if "```output" in tok.decode(ids[:j]))
    for chunk in range(1, 8):  # every place the boundary can fall
        engine = VersionedEngine(TextEngine(tok, text, start=3), tok, chunk_tokens=chunk)
        c = asyncio.run(engine.generate([1, 2, 3], Sampling(max_tokens=60, stop=("```output",))))
        assert c.token_ids == ids[:whole] and c.stop_str == "```output" and c.finish_reason == "stop", chunk


def _sets(*extra: str) -> list[str]:
    return ["task.budgets.max_response_tokens=200", "trainer.eval_every=0", "trainer.export=false",
            "trainer.chunk_tokens=200", "trainer.samples_per_step=100", "trainer.probe_tokens=0", *extra]


def _run(tmp_path, name: str, *sets: str):
    from agentrl.trainer import Trainer

    trainer = Trainer(config(tmp_path, *_sets(*sets), name=name),
                      engine=ScriptedEngine(load_tokenizer("configs/tiny_tokenizer"), [CODE_TURN, "\\boxed{42}"]))
    return asyncio.run(trainer.run()).root


@pytest.mark.slow
def test_max_staleness_0_trains_on_the_synchronous_trainers_batches(tmp_path):
    sync = _run(tmp_path, "sync", "trainer.steps=3")
    asynchronous = _run(tmp_path, "async", "trainer.steps=3", "trainer.mode=async", "trainer.max_staleness=0")
    for run in (sync, asynchronous):
        assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]

    def batches(run):
        stats = [(r["step"], r["prompt_id"], r["correct"]) for r in read_jsonl(run / "prompt_stats.jsonl")]
        samples = [[(s["id"], s["sample"], [(seg["text"], seg.get("version")) for seg in s["segments"]])
                    for s in read_jsonl(run / f"samples/step_{k}.jsonl")] for k in (1, 2, 3)]
        return stats, samples

    assert batches(asynchronous) == batches(sync)
    m = read_jsonl(asynchronous / "metrics.jsonl")
    assert [x["async/staleness_max"] for x in m] == [0.0, 0.0, 0.0] and all(x["async/dropped_stale"] == 0 for x in m)
    assert [x["async/drained_requests"] for x in m] == [0.0, 0.0, 0.0]  # s = 0: nothing in flight at an update
    assert [x["reward/mean"] for x in m] == [x["reward/mean"] for x in read_jsonl(sync / "metrics.jsonl")]


class HoldSecondTurn:
    """In front of the trainer's versioned engine: one prompt's trajectories wait before their second turn
    until `release` is set, as behind a slow tool; they are in no engine request meanwhile, so weight updates
    go on, and their first turns keep the version that sampled them."""

    def __init__(self, inner, held: tuple[int, ...], tokenizer) -> None:
        self.inner, self.held, self.tokenizer, self.release = inner, held, tokenizer, asyncio.Event()

    async def generate(self, prompt_ids, sampling, *, session=None):
        mine = tuple(prompt_ids[: len(self.held)]) == self.held
        if mine and ScriptedEngine.turn_marker in self.tokenizer.decode(prompt_ids) and not self.release.is_set():
            await self.release.wait()
        return await self.inner.generate(prompt_ids, sampling, session=session)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_group_past_the_staleness_bound_is_dropped_and_counted(tmp_path):
    from agentrl.prompt_order import PromptSampler
    from agentrl.trainer import Trainer

    cfg = config(tmp_path, *_sets("trainer.steps=4", "trainer.mode=async", "trainer.max_staleness=1"), name="held")
    trainer = Trainer(cfg, engine=ScriptedEngine(load_tokenizer("configs/tiny_tokenizer"), [CODE_TURN, "\\boxed{42}"]))
    [(_, first)] = PromptSampler(trainer.train_prompts, cfg.trainer.seed).take(1)  # the first group drawn
    trainer.rollout_engine = held = HoldSecondTurn(trainer.rollout_engine, first.token_ids, trainer.tokenizer)

    def release_at_step_3(step: int) -> None:
        if step == 3:  # the learner is at version 2; the held group's first turns are version 0
            held.release.set()

    trainer.on_step_start = release_at_step_3
    run = asyncio.run(trainer.run()).root
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert sum(m["async/dropped_stale"] for m in metrics) == 1
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    recorded = [r["prompt_id"] for r in read_jsonl(run / "prompt_stats.jsonl")]
    # every scored group is recorded for LIMR, the dropped one too (on the step that dropped it)
    assert len(recorded) == 4 * cfg.trainer.prompts_per_step + 1 and recorded.count(first.id) == 1


@pytest.mark.parametrize("off_policy", ["decoupled", "behaviour"])
def test_the_ratio_is_taken_against_the_proximal_or_the_behaviour_policy(tmp_path, off_policy):
    # the scripted engine reports logprob -1 for every token, far from the learner's own. actor/engine_kl is
    # the KL between the ratio's denominator and the engine's logprobs: the behaviour policy is the engine's
    # (0), the proximal policy is the learner's before the step (far from it)
    run = _run(tmp_path, off_policy, "trainer.steps=1", f"algo.off_policy={off_policy}")
    [m] = read_jsonl(run / "metrics.jsonl")
    if off_policy == "behaviour":
        assert m["actor/engine_kl"] == 0.0
    else:
        assert m["actor/engine_kl"] > 1.0
    assert m["actor/logprob_gap"] > 1.0  # the learner's logprobs against the engine's, in either mode
