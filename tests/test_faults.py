"""Faults a long run meets, produced on purpose on configs/debug_cpu.yaml: losses that stop being finite,
a checkpoint the disk cannot take. Each is survived and counted, or stops the run with its cause."""

from __future__ import annotations

import errno

import pytest

from agentrl.learn import Learner
from agentrl.learner.policy import PolicyWorker
from agentrl.trainer import train
from tests.test_trainer import config, read_jsonl

QUICK = ("trainer.eval_every=0", "trainer.export=false", "trainer.samples_per_step=0")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    from tests.conftest import REPO

    monkeypatch.chdir(REPO)


def test_losses_that_stay_non_finite_stop_the_run_after_the_limit(tmp_path, monkeypatch):
    real = PolicyWorker._micro_loss

    def poisoned(self, mb, batch, use_kl):  # from the learner's second optimizer step on: NaN
        loss, stats = real(self, mb, batch, use_kl)
        return (loss * float("nan"), stats) if self.steps + self.skipped_steps >= 1 else (loss, stats)

    monkeypatch.setattr(PolicyWorker, "_micro_loss", poisoned)
    with pytest.raises(RuntimeError, match=r"the actor's last 2 optimizer steps .* not finite") as raised:
        train(config(tmp_path, "trainer.steps=5", "trainer.max_skipped_in_a_row=2", "trainer.save_every=0", *QUICK))
    assert "training step 3 of 5" in "\n".join(raised.value.__notes__)
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [x["actor/step_skipped"] for x in m] == [0.0, 1.0]  # step 2 skipped, counted, the run went on
    assert m[-1]["actor/skipped_steps"] == 1.0


def test_a_checkpoint_the_disk_cannot_take_stops_the_run_and_leaves_the_last_one_whole(tmp_path, monkeypatch):
    real = Learner.save

    def full_disk(self, path, extra):
        if extra["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, path, extra)

    monkeypatch.setattr(Learner, "save", full_disk)
    with pytest.raises(RuntimeError, match=r"checkpoint of step 2 could not be written .*No space left.* still step_1"):
        train(config(tmp_path, "trainer.steps=3", "trainer.save_every=1", *QUICK))
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1"]  # no half-written step_2
    monkeypatch.setattr(Learner, "save", real)
    train(config(tmp_path, "trainer.steps=3", "trainer.save_every=1", *QUICK))  # resumes from step 1
    assert [x["step"] for x in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
