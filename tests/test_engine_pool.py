"""engine/pool.py: several engines behind one, each trajectory on one engine by its session key, weights
to every engine, answers the same as one engine's, and every engine closed."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentrl.engine import Sampling
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


def test_sessions_stick_to_one_engine_and_spread_over_all() -> None:
    engines = [ProbeEngine(), ProbeEngine(), ProbeEngine()]
    pool = EnginePool(engines)
    chosen = {f"traj-{i}/0": pool.pick(f"traj-{i}/0") for i in range(30)}
    assert all(pool.pick(s) is e for s, e in chosen.items())  # every turn of a trajectory: the same engine
    assert {id(e) for e in chosen.values()} == {id(e) for e in engines}
    assert [pool.pick(None) for _ in range(4)] == [engines[0], engines[1], engines[2], engines[0]]
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([])


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
    import agentrl.engine

    monkeypatch.setattr(agentrl.engine, "BUCKET_BYTES", 16)
    encoded = []
    real = agentrl.engine.bucket_bytes
    monkeypatch.setattr(agentrl.engine, "bucket_bytes", lambda bucket: encoded.append(1) or real(bucket))
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
