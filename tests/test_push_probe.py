"""Every weight push is checked: after it the engine samples a fixed probe and the learner scores the same
tokens (weight_sync.PushProbe). On configs/debug_cpu.yaml with the transformers engine, a push that did not
take (the engine keeps the old weights) or that lost tensors fails the run at that step, naming the
transport; a push that did take shows a gap at the numerics' level in `sync/probe_gap` every step."""

from __future__ import annotations

import pytest

from agentrl.engine.hf import HFEngine
from agentrl.learn import Learner
from agentrl.trainer import train
from tests.test_trainer import config, read_jsonl

# The entropy term moves the weights whatever the rewards; a large step moves them past the probe's tolerance.
FAST = ("trainer.eval_every=0", "trainer.export=false", "trainer.save_every=0", "trainer.samples_per_step=0",
        "learner.optim.lr=0.01", "algo.entropy_coef=0.05")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def test_every_push_is_checked_and_a_taken_one_shows_only_numerics(tmp_path):
    run = train(config(tmp_path, "trainer.steps=3", *FAST)).root
    gaps = [m["sync/probe_gap"] for m in read_jsonl(run / "metrics.jsonl")]
    assert len(gaps) == 3 and all(0 <= g < 1e-4 for g in gaps)  # float32 on both sides


def test_a_push_the_engine_never_received_fails_the_run_naming_step_and_transport(tmp_path, monkeypatch):
    async def lost(self, engine):  # the transport reports success and delivers nothing
        return {"timing/weight_sync": 0.0}

    monkeypatch.setattr(Learner, "push", lost)
    with pytest.raises(RuntimeError, match=r"step 1: after the weight push \(tensors\) engine 0's logprobs"):
        train(config(tmp_path, "trainer.steps=3", *FAST))


def test_a_push_that_loses_tensors_fails_the_run(tmp_path, monkeypatch):
    real = HFEngine.update_weights

    async def partial(self, named_tensors):  # the first layer's tensors never arrive
        await real(self, [(name, t) for name, t in named_tensors if ".layers.0." not in name])

    monkeypatch.setattr(HFEngine, "update_weights", partial)
    with pytest.raises(RuntimeError, match=r"step 1: .*trainer\.probe_tolerance"):
        train(config(tmp_path, "trainer.steps=3", *FAST))


def test_the_tolerance_is_set_by_the_engine_unless_given(tmp_path):
    assert config(tmp_path).trainer.probe_tolerance == 0.01
    assert config(tmp_path, "trainer.probe_tolerance=0.5").trainer.probe_tolerance == 0.5
