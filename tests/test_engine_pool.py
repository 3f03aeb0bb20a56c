"""engine/pool.py: several engines behind one, each trajectory on one engine by its session key, weights
to every engine, answers the same as one engine's, and every engine closed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentrl.engine import Completion, Sampling
from agentrl.engine.hf import HFEngine
from agentrl.engine.pool import EnginePool
from agentrl.engine.process import ProcessEngine
from tests.test_engine_process import FACTORY, PROMPTS, BytesProbe, ProbeEngine, _ids, _save_model


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("pool-models")
    return _save_model(root / "a", tiny_tokenizer, 0), _save_model(root / "b", tiny_tokenizer, 1)


async def _answers(engine, tokenizer, sampling, sessions):
    return await asyncio.gather(*(engine.generate(_ids(tokenizer, p), sampling, session=s)
                                  for p, s in zip(PROMPTS * 2, sessions, strict=True)))


class Recorder:
    """An in-process engine that records what reaches it; bucket loads can be held at a gate or fail."""

    def __init__(self, name: str, max_context_tokens: int | None = 100, fail_bucket: int | None = None):
        self.name, self.max_context_tokens, self.fail_bucket = name, max_context_tokens, fail_bucket
        self.sessions: list[str | None] = []
        self.buckets: list[bytes] = []
        self.loaded = self.slept = self.woke = self.started = 0
        self.gate: asyncio.Event | None = None  # bucket loads from bucket `gate_from` on wait for it where set
        self.gate_from = 0
        self.hold: asyncio.Event | None = None  # requests wait for it where set
        self.loading = asyncio.Event()  # set when a bucket load has begun

    async def generate(self, prompt_ids, sampling, *, session=None):
        self.sessions.append(session)
        if self.hold is not None:
            await self.hold.wait()
        return Completion(list(prompt_ids), [0.0] * len(prompt_ids), "stop")

    async def load_weight_bucket(self, payload: bytes) -> int:
        self.loading.set()
        self.started += 1
        if self.gate is not None and len(self.buckets) >= self.gate_from:
            await self.gate.wait()
        if self.fail_bucket == len(self.buckets):
            raise OSError(f"{self.name} could not load bucket {self.fail_bucket}")
        self.buckets.append(payload)
        return 1

    def weights_loaded(self) -> None:
        self.loaded += 1

    async def sleep(self, level: int = 1) -> None:
        self.slept += 1

    def wake(self) -> None:  # a plain method: awaited only where it returns an awaitable
        self.woke += 1


async def _until(condition, bound_s: float = 30.0) -> None:
    """Yield to the loop until `condition()` holds (a bound, not a timing: fails after `bound_s`)."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0)


def test_sessions_stick_to_one_engine_and_spread_over_all() -> None:
    engines = [Recorder("a"), Recorder("b", max_context_tokens=40), Recorder("c", max_context_tokens=None)]
    pool = EnginePool(engines)
    assert pool.max_context_tokens == 40  # the smallest limit any engine has
    chosen = {f"traj-{i}/0": pool.pick(f"traj-{i}/0") for i in range(30)}
    assert all(pool.pick(s) is e for s, e in chosen.items())  # every turn of a trajectory: the same engine
    assert {id(e) for e in chosen.values()} == {id(e) for e in engines}
    assert [pool.pick(None) for _ in range(4)] == [engines[0], engines[1], engines[2], engines[0]]

    async def go():
        for s in chosen:
            await pool.generate([1], Sampling(max_tokens=1), session=s)
        await pool.sleep()
        await pool.wake()

    asyncio.run(go())
    for e in engines:  # each request reached the engine pick() names for its session
        assert e.sessions == [s for s, chosen_engine in chosen.items() if chosen_engine is e]
        assert (e.slept, e.woke) == (1, 1)
    assert EnginePool([Recorder("a", None)]).max_context_tokens is None
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])


def test_an_update_waits_for_no_one_and_no_one_generates_during_it(monkeypatch) -> None:
    import agentrl.engine.weights

    monkeypatch.setattr(agentrl.engine.weights, "BUCKET_BYTES", 8)
    engines = [Recorder("a"), Recorder("b")]
    pool = EnginePool(engines)
    weights = [("w", torch.ones(2)), ("v", torch.zeros(2))]  # two buckets

    async def go():
        engine = pool.pick("s")
        engine.hold = asyncio.Event()
        running = asyncio.create_task(pool.generate([1], Sampling(max_tokens=1), session="s"))
        await _until(lambda: engine.sessions)  # the request has reached its engine
        with pytest.raises(RuntimeError, match="1 requests are still generating"):
            await pool.update_weights(weights)
        assert engines[0].buckets == engines[1].buckets == []  # refused before any weight moved
        engine.hold.set()
        await running
        engines[0].gate = asyncio.Event()
        update = asyncio.create_task(pool.update_weights(weights))
        await asyncio.wait_for(engines[0].loading.wait(), 30)  # the first bucket is loading: held at the gate
        with pytest.raises(RuntimeError, match="during update_weights"):
            await pool.generate([1], Sampling(max_tokens=1), session="s")
        with pytest.raises(RuntimeError, match="one update at a time"):
            await pool.update_weights(weights)
        engines[0].gate.set()
        assert await asyncio.wait_for(update, 30) == 2
        return await pool.generate([1], Sampling(max_tokens=1), session="s")

    assert asyncio.run(go()).token_ids == [1]
    assert [len(e.buckets) for e in engines] == [2, 2] and [e.loaded for e in engines] == [1, 1]


def test_a_failed_update_settles_every_engine_and_blocks_generation_until_one_succeeds(monkeypatch) -> None:
    import agentrl.engine.weights

    monkeypatch.setattr(agentrl.engine.weights, "BUCKET_BYTES", 8)
    engines = [Recorder("a", fail_bucket=1), Recorder("b")]
    pool = EnginePool(engines)
    weights = [("w", torch.ones(2)), ("v", torch.zeros(2)), ("u", torch.ones(2))]  # three buckets

    async def go():
        engines[1].gate, engines[1].gate_from = asyncio.Event(), 1  # b finishes bucket 1 only after a failed it
        update = asyncio.create_task(pool.update_weights(weights))
        await _until(lambda: engines[1].started == 2)  # b is on bucket 1, held
        for _ in range(10):
            await asyncio.sleep(0)
        assert not update.done()  # a has failed, but the update waits for b to settle
        engines[1].gate.set()
        with pytest.raises(OSError, match="a could not load bucket 1"):
            await update
        assert [len(e.buckets) for e in engines] == [1, 2]  # b finished the bucket a failed; none went further
        assert [e.loaded for e in engines] == [0, 0]  # the update never completed
        with pytest.raises(RuntimeError, match="mix of old and new weights"):
            await pool.generate([1], Sampling(max_tokens=1), session="s")
        engines[0].fail_bucket = None
        assert await pool.update_weights(weights) == 3
        return await pool.generate([1], Sampling(max_tokens=1), session="s")

    assert asyncio.run(go()).token_ids == [1]


def test_both_engines_load_a_bucket_at_once(monkeypatch) -> None:
    engines = [Recorder("a"), Recorder("b")]
    pool = EnginePool(engines)

    async def go():
        for e in engines:
            e.gate = asyncio.Event()
        update = asyncio.create_task(pool.update_weights([("w", torch.ones(2))]))
        # both loads begin before either may finish: one after the other would never start b's
        await asyncio.wait_for(asyncio.gather(*(e.loading.wait() for e in engines)), 30)
        for e in engines:
            e.gate.set()
        return await update

    assert asyncio.run(go()) == 1


@pytest.mark.slow
def test_two_engine_processes_answer_as_one_engine_and_take_new_weights(models, tiny_tokenizer) -> None:
    sessions = [f"t{i}/0" for i in range(2 * len(PROMPTS))]
    greedy, seeded = Sampling(max_tokens=10, temperature=0), Sampling(max_tokens=10, seed=3)
    here_a = HFEngine.from_pretrained(models[0], max_batch=1)
    here_b = HFEngine.from_pretrained(models[1], max_batch=1)
    pool = EnginePool([ProcessEngine(FACTORY, {"path": models[0], "max_batch": 1}) for _ in range(2)])
    assert pool.max_context_tokens == 512
    assert len({id(pool.pick(s)) for s in sessions}) == 2  # both processes serve

    async def go():
        try:
            out = {}
            for name, sampling in (("greedy", greedy), ("seeded", seeded)):
                out[name] = (await _answers(pool, tiny_tokenizer, sampling, sessions),
                             await _answers(here_a, tiny_tokenizer, sampling, sessions))
            count = await pool.update_weights(here_b.model.named_parameters())
            out["updated"] = (await _answers(pool, tiny_tokenizer, greedy, sessions),
                              await _answers(here_b, tiny_tokenizer, greedy, sessions))
            return out, count
        finally:
            await pool.aclose()

    out, count = asyncio.run(go())
    for ours, theirs in out.values():
        assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
        assert [c.logprobs for c in ours] == [c.logprobs for c in theirs]
    assert [c.token_ids for c in out["updated"][0]] != [c.token_ids for c in out["greedy"][0]]
    assert count is None  # HFEngine reports no count
    assert all(e.process.exitcode == 0 for e in pool.engines)


def test_each_bucket_is_encoded_once_and_reaches_every_engine_process(monkeypatch) -> None:
    import agentrl.engine.weights

    monkeypatch.setattr(agentrl.engine.weights, "BUCKET_BYTES", 16)
    encoded = []
    real = agentrl.engine.weights.encode_bucket
    monkeypatch.setattr(agentrl.engine.weights, "encode_bucket", lambda bucket: encoded.append(1) or real(bucket))
    weights = [("a", torch.arange(4.0)), ("b", torch.arange(4.0, 12.0).view(2, 4)), ("c", torch.tensor([1.5]))]
    pool = EnginePool([ProcessEngine(BytesProbe), ProcessEngine(BytesProbe)])

    async def go():
        try:
            count = await pool.update_weights(weights)
            return count, [await e.call("received") for e in pool.engines]
        finally:
            await pool.aclose()

    count, received = asyncio.run(go())
    assert count == 3 and len(encoded) == 3  # three buckets of 16 bytes, each encoded once for both engines
    for buckets, resets in received:
        got = {name: values for bucket in buckets for name, (_, values) in bucket.items()}
        assert got == {"a": [0.0, 1.0, 2.0, 3.0], "b": [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]], "c": [1.5]}
        assert resets == 1


def test_engines_that_take_tensors_get_each_bucket(models, tiny_tokenizer) -> None:
    pool = EnginePool([HFEngine.from_pretrained(models[0], max_batch=1) for _ in range(2)])
    b = HFEngine.from_pretrained(models[1], max_batch=1)
    asyncio.run(pool.update_weights(b.model.named_parameters()))
    for engine in pool.engines:
        for (name, ours), (_, theirs) in zip(engine.model.named_parameters(), b.model.named_parameters(), strict=True):
            assert torch.equal(ours, theirs), name


def test_aclose_closes_every_engine_even_when_one_fails(tmp_path) -> None:
    marker = tmp_path / "closed"
    pool = EnginePool([ProcessEngine(ProbeEngine, {"close_raises": True}), ProcessEngine(ProbeEngine, {"marker": str(marker)})])
    with pytest.raises(OSError, match="could not close"):
        asyncio.run(pool.aclose())
    assert marker.read_text() == "closed\n"
    assert not any(e.process.is_alive() for e in pool.engines)


class StartProbe:
    """Made by vllm_processes in each child: records its memory share; the second fails where told to."""

    max_context_tokens = 7

    def __init__(self, model: str, gpu_memory_utilization: float, marker_dir: str, fail_second: bool = False):
        root = Path(marker_dir)
        n = len(list(root.glob("started-*")))  # the children start one after another
        if n and fail_second:
            raise RuntimeError("the second engine could not start")
        (root / f"started-{n}").write_text(f"{model} {gpu_memory_utilization}")
        self.closed = root / f"closed-{n}"

    async def aclose(self) -> None:
        self.closed.write_text("closed")


@pytest.mark.slow
def test_vllm_processes_splits_the_memory_and_ends_started_children_when_one_fails(tmp_path) -> None:
    from agentrl.engine.vllm import vllm_processes

    ok, failed = tmp_path / "ok", tmp_path / "failed"
    ok.mkdir(), failed.mkdir()
    pool = vllm_processes("m", 2, gpu_memory_utilization=0.8, factory=StartProbe, marker_dir=str(ok))
    assert [(ok / f"started-{i}").read_text() for i in range(2)] == ["m 0.4", "m 0.4"]
    assert pool.max_context_tokens == 7 and all(isinstance(e, ProcessEngine) for e in pool.engines)
    asyncio.run(pool.aclose())
    assert sorted(p.name for p in ok.glob("closed-*")) == ["closed-0", "closed-1"]
    with pytest.raises(RuntimeError, match="could not make") as info:
        vllm_processes("m", 2, factory=StartProbe, marker_dir=str(failed), fail_second=True)
    assert "the second engine could not start" in str(info.value.__cause__)
    assert (failed / "closed-0").read_text() == "closed"  # the first child closed its engine and ended
    with pytest.raises(ValueError, match="processes must be at least 1"):
        vllm_processes("m", 0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        vllm_processes("m", 2, gpu_memory_utilization=1.5)


class TensorTaker:
    """Takes weights as tensors only (no buckets, as HFEngine); fails at bucket `fail_at` where set."""

    max_context_tokens = None

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.buckets = fail_at, []

    async def update_weights(self, bucket):
        if self.fail_at == len(self.buckets):
            raise OSError("could not take these tensors")
        await asyncio.sleep(0)  # the other engine's call runs meanwhile
        self.buckets.append([name for name, _ in bucket])

    async def generate(self, prompt_ids, sampling, *, session=None):
        return Completion(list(prompt_ids), [0.0] * len(prompt_ids), "stop")


def test_tensor_taking_engines_settle_a_failed_bucket_and_a_cancelled_update_blocks_generation(monkeypatch) -> None:
    import agentrl.engine.weights

    monkeypatch.setattr(agentrl.engine.weights, "BUCKET_BYTES", 8)
    engines = [TensorTaker(fail_at=1), TensorTaker()]
    pool = EnginePool(engines)
    weights = [("w", torch.ones(2)), ("v", torch.zeros(2)), ("u", torch.ones(2))]

    async def go():
        with pytest.raises(OSError, match="could not take"):
            await pool.update_weights(weights)
        assert [e.buckets for e in engines] == [[["w"]], [["w"], ["v"]]]  # b finished bucket 1; no bucket 2
        with pytest.raises(RuntimeError, match="mix of old and new weights"):
            await pool.generate([1], Sampling(max_tokens=1))
        engines[0].fail_at = None
        await pool.update_weights(weights)
        await pool.generate([1], Sampling(max_tokens=1))
        held = [Recorder("a"), Recorder("b")]
        other = EnginePool(held)
        held[0].gate = asyncio.Event()
        update = asyncio.create_task(other.update_weights(weights))
        await _until(lambda: held[0].started == 1)
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        with pytest.raises(RuntimeError, match="mix of old and new weights"):  # a cancelled update counts as failed
            await other.generate([1], Sampling(max_tokens=1))

    asyncio.run(go())


class PlainCloseFails:
    max_context_tokens = None

    def aclose(self) -> None:
        raise OSError("plain close failed")


class CancelledInside:
    max_context_tokens = None

    def __init__(self):
        self.closed = False

    async def sleep(self, level: int = 1) -> None:
        raise asyncio.CancelledError  # cancelled inside the engine, not by the caller

    async def aclose(self) -> None:
        self.closed = True


def test_one_engine_failing_at_once_stops_no_other_and_errors_come_first() -> None:
    async def go():
        inside = CancelledInside()
        with pytest.raises(OSError, match="plain close failed"):
            await EnginePool([PlainCloseFails(), inside]).aclose()
        assert inside.closed  # closed although the first engine's plain aclose raised before any await
        with pytest.raises(RuntimeError, match="cancelled inside an engine"):
            await EnginePool([inside]).sleep()  # not a CancelledError: the caller was not cancelled
        failing = Recorder("f")
        failing.sleep = None  # an engine without sleep: its TypeError comes before the cancellation's error
        with pytest.raises(TypeError) as info:
            await EnginePool([inside, failing]).sleep()
        assert any("cancelled inside an engine" in note for note in info.value.__notes__)

    asyncio.run(go())
