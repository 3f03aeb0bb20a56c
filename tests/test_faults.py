"""Faults a long run meets, produced on purpose on configs/debug_cpu.yaml: losses that stop being finite, a
checkpoint the disk cannot take, a tool service that stays down, waits that never end, an engine process
that dies; and a chaos run with several at once, then its resume. Each is survived and counted, or stops
the run with its cause."""

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


def test_running_out_of_gpu_memory_names_the_settings_to_change(tmp_path, monkeypatch):
    import torch

    def out_of_memory(self, mb, batch, use_kl):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.16 GiB.")

    monkeypatch.setattr(PolicyWorker, "_micro_loss", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        train(config(tmp_path, "trainer.steps=2", "learner.token_budget=512", *QUICK))
    notes = "\n".join(raised.value.__notes__)
    assert "training step 1 of 2" in notes and "learner.token_budget (512)" in notes


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


def test_service_faults_are_told_from_the_models_own_failures() -> None:
    from agentrl.types import ToolResult

    assert [ToolResult("", error=e).service_fault for e in ("connection", "no_answer", "http_503", "sandbox_error")] \
        == [True] * 4
    assert not any(ToolResult("", error=e).service_fault  # the model's program or call, not the service
                   for e in (None, "timeout", "execution_error", "malformed", "unknown_tool", "http_413", "http_422"))


@pytest.mark.slow
def test_a_tool_service_that_stays_down_errors_its_trajectories_then_stops_the_run(tmp_path):
    import asyncio

    from agentrl.services import free_port
    from tests.test_trainer import CODE_TURN, _scripted

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trainer = _scripted(tmp_path, [CODE_TURN, "\\boxed{42}"], "trainer.steps=4", f"services.sandbox={dead}",
                        "trainer.max_errored_steps=3", "trainer.samples_per_step=0",
                        "services.tool_retries=1")
    with pytest.raises(RuntimeError, match=r"step 3: 100% of the step's trajectories are errored \(tool: 16; .*"
                                           r"3 steps in a row \(trainer.max_errored_steps\)"):
        asyncio.run(trainer.run())
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [x["rollout/errored/tool"] for x in m] == [1.0, 1.0]  # steps 1 and 2: warned, counted
    assert not any(k.startswith("actor/") for x in m for k in x)  # nothing errored was trained on


@pytest.mark.slow
def test_an_engine_that_stops_answering_in_the_middle_of_a_push_stops_the_run(tmp_path, monkeypatch):
    import asyncio

    from agentrl.engine.hf import HFEngine

    real = HFEngine.update_weights
    pushes = []

    async def stuck(self, named_tensors):  # the initial push goes through; the next one hangs after a tensor
        pushes.append(1)
        if len(pushes) == 1:
            return await real(self, named_tensors)
        await real(self, [next(iter(named_tensors))])
        await asyncio.Event().wait()

    monkeypatch.setattr(HFEngine, "update_weights", stuck)
    # a bound the initial push and its check keep to even on a busy machine; step 1's push never ends
    with pytest.raises(RuntimeError, match=r"step 1: the weight push \(tensors\) and its check did not finish within "
                                           r"10 s \(trainer.push_timeout_s\)"):
        train(config(tmp_path, "trainer.steps=2", "trainer.push_timeout_s=10", "trainer.save_every=0", *QUICK))


def test_an_engine_request_that_never_answers_stops_the_run(tmp_path, monkeypatch):
    import asyncio

    from agentrl.engine.hf import HFEngine

    async def silent(self, prompt_ids, sampling, *, session=None):
        if sampling.max_tokens != 32:  # the probe (trainer.probe_tokens) is answered; rollout requests are not
            await asyncio.Event().wait()
        return await real(self, prompt_ids, sampling, session=session)

    real = HFEngine.generate
    monkeypatch.setattr(HFEngine, "generate", silent)
    with pytest.raises(RuntimeError, match=r"the engine \(HFEngine\) did not answer a request within 1 s "
                                           r"\(engine.request_timeout_s\)"):
        train(config(tmp_path, "trainer.steps=1", "engine.request_timeout_s=1", "trainer.save_every=0", *QUICK))


@pytest.mark.slow
def test_a_ray_actor_that_never_returns_stops_the_run(tmp_path):
    import types

    ray = pytest.importorskip("ray")
    from agentrl.ray_placement import RayLearner, ray_wait

    @ray.remote
    class Stuck:
        def learn(self, groups):
            import time

            time.sleep(3600)  # a rank lost in a collective

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        learner = RayLearner.__new__(RayLearner)  # its _all alone, over one stuck actor
        learner.ranks = [Stuck.remote()]
        learner.config = types.SimpleNamespace(placement=types.SimpleNamespace(call_timeout_s=1.0))
        with pytest.raises(RuntimeError, match=r"learner rank 0 .* did not return from learn within 1 s "
                                               r"\(placement.call_timeout_s\)"):
            learner._all("learn", [])
        with pytest.raises(RuntimeError, match=r"starting the 1 engine actors \(_EngineActor\) did not finish within "
                                               r"1 s \(placement.call_timeout_s\)"):
            ray_wait([Stuck.remote().learn.remote([])], "starting the 1 engine actors (_EngineActor)", 1.0)
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("during", ["rollout", "learning"])
def test_an_engine_process_that_dies_mid_run_comes_back_with_the_learners_weights(tmp_path, monkeypatch, during):
    import asyncio
    import os
    import signal

    from agentrl.build import build_lm, run_tokenizer
    from agentrl.engine.process import ProcessEngine
    from agentrl.trainer import Trainer

    cfg = config(tmp_path, "trainer.steps=3", "trainer.save_every=0", "algo.entropy_coef=0.05", *QUICK)
    model_dir = tmp_path / "init"
    build_lm(cfg).save_pretrained(model_dir)
    run_tokenizer(cfg).save_pretrained(model_dir)
    engine = ProcessEngine("agentrl.engine.hf:HFEngine.from_pretrained", {"path": str(model_dir), "seed": 0})
    trainer = Trainer(cfg, engine=engine)

    def kill() -> None:
        os.kill(engine.process.pid, signal.SIGKILL)
        engine.process.join()

    if during == "rollout":  # the step's rollout requests then fail: the engine comes back and they go again
        trainer.on_step_start = lambda step: kill() if step == 2 else None
    else:  # nothing waits on the engine then: the weight push after the update finds it dead, and revives it
        learn = Learner.learn

        def kill_then_learn(self, groups):
            if trainer.step == 2:
                kill()
            return learn(self, groups)

        monkeypatch.setattr(Learner, "learn", kill_then_learn)
    try:
        run = asyncio.run(trainer.run()).root
    finally:
        asyncio.run(engine.aclose())
    m = read_jsonl(run / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3]
    assert [x["engine/restarts"] for x in m] == [0.0, 1.0, 1.0]
    assert all(x["sync/probe_gap"] < 1e-4 for x in m)  # after the restart too: the learner's weights, checked
    assert all(x["rollout/errored"] == 0.0 for x in m)  # the failed requests went again: no trajectory lost


class ForcedEngine:
    """A real model's weights that write a script: turn k of every trajectory is `turns[k]` (as test_trainer's
    ScriptedEngine), scored by the model at the request's temperature, so that the tool calls are certain while
    the weight push and its check are real."""

    turn_marker = "```output"

    def __init__(self, path: str, turns: list[str]) -> None:
        from agentrl.engine.hf import HFEngine

        self.inner = HFEngine.from_pretrained(path, seed=0)
        self.tokenizer, self.turns = self.inner.tokenizer, turns
        self.max_context_tokens = self.inner.max_context_tokens

    async def generate(self, prompt_ids, sampling, *, session=None):
        import torch

        from agentrl.engine import Completion

        turn = self.tokenizer.decode(prompt_ids).count(self.turn_marker)
        ids = self.tokenizer.encode(self.turns[min(turn, len(self.turns) - 1)], add_special_tokens=False)
        stop = next((s for s in sampling.stop if self.tokenizer.decode(ids).endswith(s)), None)
        ids = (ids if stop else ids + [self.tokenizer.eos_token_id])[: sampling.max_tokens]
        with torch.no_grad():
            logits = self.inner.model(input_ids=torch.tensor([list(prompt_ids) + ids])).logits[0].float()
        scaled = torch.log_softmax(logits[len(prompt_ids) - 1: -1] / sampling.temperature, -1)
        return Completion(ids, scaled.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist(), "stop", stop)

    async def update_weights(self, named_tensors) -> None:
        await self.inner.update_weights(named_tensors)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.slow
def test_chaos_a_run_survives_its_faults_stops_on_a_lost_push_and_resumes(tmp_path, monkeypatch):
    """One seeded run: the engine process killed (step 2), the sandbox killed (step 3), a tool call that
    never answers (step 4), a push that silently delivers nothing (step 5); then a resume to the end."""
    import asyncio
    import os
    import signal

    from agentrl.build import build_lm, run_tokenizer
    from agentrl.engine.process import ProcessEngine
    from agentrl.tools.code import CodeTool
    from agentrl.trainer import Trainer
    from tests.test_trainer import CODE_TURN

    sets = ("trainer.steps=6", "trainer.save_every=1", "rollout.tool_timeout_s=3", "learner.optim.lr=0.01",
            "algo.entropy_coef=0.05", *QUICK)
    cfg = config(tmp_path, *sets)
    model_dir = tmp_path / "init"
    build_lm(cfg).save_pretrained(model_dir)
    run_tokenizer(cfg).save_pretrained(model_dir)

    def engine() -> ProcessEngine:
        return ProcessEngine(f"{__name__}:ForcedEngine", {"path": str(model_dir), "turns": [CODE_TURN, "\\boxed{42}"]})

    fault = {"step": 0}
    real_call, real_push = CodeTool.call, Learner.push

    async def call(self, tool_call):
        if fault["step"] == 4 and not fault.get("hung"):
            fault["hung"] = True
            await asyncio.Event().wait()  # never answers: rollout.tool_timeout_s ends it
        return await real_call(self, tool_call)

    async def push(self, target):
        return {"timing/weight_sync": 0.0} if fault["step"] == 5 else await real_push(self, target)

    monkeypatch.setattr(CodeTool, "call", call)
    monkeypatch.setattr(Learner, "push", push)
    first = engine()
    trainer = Trainer(cfg, engine=first)

    def inject(step: int) -> None:
        fault["step"] = step
        if step == 2:
            os.kill(first.process.pid, signal.SIGKILL)
        elif step == 3:
            os.killpg(trainer.services.managed[0].proc.pid, signal.SIGKILL)

    trainer.on_step_start = inject
    try:
        with pytest.raises(RuntimeError, match=r"step 5: after the weight push \(tensors\) engine 0's logprobs"):
            asyncio.run(trainer.run())
    finally:
        asyncio.run(first.aclose())
    m = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [x["step"] for x in m] == [1, 2, 3, 4]
    assert [x["engine/restarts"] for x in m] == [0.0, 1.0, 1.0, 1.0]
    assert m[3]["services/sandbox_restarts"] == 1.0 and m[3]["rollout/errored/tool"] > 0  # the hung call
    for x in m:  # errored trajectories are out of the batch: only the others were trained on
        assert x.get("batch/trajectories", 0.0) == round(16 * (1 - x["rollout/errored"]))  # 0: all errored

    fault["step"] = 0
    again = engine()
    try:
        asyncio.run(Trainer(config(tmp_path, *sets), engine=again).run())  # from step 4's checkpoint
    finally:
        asyncio.run(again.aclose())
    assert [x["step"] for x in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
