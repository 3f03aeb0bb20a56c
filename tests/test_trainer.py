"""`agentrl train` end to end on a CPU: configs/debug_cpu.yaml with a tiny random model, the real sandbox
over loopback HTTP (started by the trainer), real learner steps; resume, kill -9, a dying sandbox, the
weight push, a reward the model cannot hack through its tool, and a run that learns."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import StrictModel
from agentrl.engine import Completion, Sampling
from agentrl.learner.packing import pack
from agentrl.rewards import REWARDS
from agentrl.run_config import load_run_config
from agentrl.trainer import Trainer, train
from agentrl.types import Prompt, RewardResult, Segment, StopReason, Trajectory
from tests.conftest import REPO

DEBUG = REPO / "configs" / "debug_cpu.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the config's relative paths (tasks/, configs/) are taken from here


def config(tmp_path: Path, *sets: str, name: str = "run"):
    return load_run_config(DEBUG, [f"trainer.run_dir={tmp_path / name}", "logging.progress=false", *sets])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_debug_config_runs_two_steps_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(config(tmp_path, "algo.advantage=gae"))
    run = asyncio.run(trainer.run()).root
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    names = {k.split("/")[0] for m in metrics for k in m if "/" in k}
    assert {"reward", "rollout", "tool", "actor", "critic", "val", "perf", "timing"} <= names
    assert {"timing/rollout", "timing/logprobs", "timing/train", "timing/weight_sync", "timing/checkpoint",
            "timing/step"} <= set(metrics[0])
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert (run / "checkpoints" / "step_2" / "actor" / "learner.pt").exists()
    assert (run / "checkpoints" / "step_2" / "critic" / "learner.pt").exists()
    samples = read_jsonl(run / "samples" / "step_1.jsonl")
    assert samples and all(s["segments"][0]["source"] == "model" and "stop_reason" in s for s in samples)
    stats = read_jsonl(run / "prompt_stats.jsonl")
    assert len(stats) == 2 * 4 and {"epoch", "prompt_id", "correct", "n"} <= set(stats[0])
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    config_text = (run / "config.yaml").read_text()
    assert "tasks/data/arithmetic.jsonl" in config_text and "temperature: 1.0" in config_text

    exported = AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, trainer.engine.model(input_ids=ids).logits, atol=2e-2)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(run / "export").eos_token == "<|im_end|>"


def _step_records(run: Path, step: int) -> tuple[list[str], dict]:
    stats = [r["prompt_id"] for r in read_jsonl(run / "prompt_stats.jsonl") if r["step"] == step]
    metrics = next(m for m in read_jsonl(run / "metrics.jsonl") if m["step"] == step)
    return stats, metrics


@pytest.mark.slow
def test_a_resumed_run_continues_as_the_uninterrupted_one(tmp_path):
    """Stopped after step 2 and resumed: step 3 takes the same prompts and reaches the same loss. An
    entropy bonus keeps the loss non-zero while every reward is still equal."""
    sets = ("algo.entropy_coef=0.01", "trainer.eval_every=0", "trainer.export=false")
    whole = train(config(tmp_path, "trainer.steps=3", *sets, name="whole")).root
    part = config(tmp_path, "trainer.steps=2", *sets, name="part")
    train(part)
    resumed = train(config(tmp_path, "trainer.steps=3", *sets, name="part")).root
    prompts, metrics = _step_records(whole, 3)
    prompts_resumed, metrics_resumed = _step_records(resumed, 3)
    assert prompts == prompts_resumed
    # the same samples, token for token: the HF engine seeds every request by run, step, prompt, sample, turn
    def sampled(run: Path) -> list[dict]:  # all but the wall-clock timings
        return [{k: v for k, v in row.items() if k != "timings"} for row in read_jsonl(run / "samples/step_3.jsonl")]

    assert sampled(whole) and sampled(whole) == sampled(resumed)
    assert metrics_resumed["actor/loss"] == pytest.approx(metrics["actor/loss"], rel=1e-5, abs=1e-7)
    assert metrics_resumed["actor/loss"] != 0.0
    assert [m["step"] for m in read_jsonl(resumed / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_completes_with_nothing_half_written(tmp_path):
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "agentrl.cli", "train", str(DEBUG), "--set", f"trainer.run_dir={run}",
               "--set", "trainer.steps=4", "--set", "logging.progress=false", "--set", "trainer.eval_every=0"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    latest = run / "checkpoints" / "latest"
    while not (latest.exists() and latest.read_text().strip() == "step_2"):  # a checkpoint, then mid-step 3
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint of step 2 within 300 s"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(command + ["--resume", str(run)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert sorted(r["step"] for r in read_jsonl(run / "prompt_stats.jsonl")) == sorted([1, 2, 3, 4] * 4)
    leftovers = [p for p in run.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp" in p.name
                 or (p.name.startswith(".") and p.name != ".metadata")]  # .metadata: torch's checkpoint index
    assert not leftovers
    for path in run.rglob("*.jsonl"):
        read_jsonl(path)  # every line whole
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_4"


def test_the_engine_samples_from_the_learners_weights_after_a_push(tmp_path):
    trainer = Trainer(config(tmp_path, "trainer.steps=2", "trainer.eval_every=0", "trainer.export=false",
                             "algo.entropy_coef=0.05"))
    asyncio.run(trainer.run())
    prompt = Prompt("p", "", (5, 17, 99, 3), "", "")
    trajectory = Trajectory(prompt, [Segment("model", [250, 41, 7, 300], [0.0] * 4)], StopReason.EOS)
    [batch] = pack([trajectory], 64)
    learner_R = trainer.learner.policy.compute_logprobs(batch)[0]
    with torch.no_grad():
        logits = trainer.engine.model(input_ids=torch.tensor([[5, 17, 99, 3, 250, 41, 7, 300]])).logits[0]
    engine_R = torch.log_softmax(logits.float(), -1)[3:7].gather(1, torch.tensor([[250], [41], [7], [300]]))[:, 0]
    assert torch.allclose(learner_R, engine_R, atol=1e-5)
    assert trainer.learner.policy.steps == 2  # the weights did move: the comparison is after real updates


class ScriptedEngine:
    """A test double for the model: turn k of every trajectory writes `turns[k]` (then EOS), with logprob
    -1 per token. Everything around it is real: the sandbox, the format, the reward, the learner."""

    max_context_tokens = None

    turn_marker = "```output"  # what each tool observation adds to the context, to count the turns by

    def __init__(self, tokenizer, turns: list[str]) -> None:
        self.tokenizer, self.turns = tokenizer, turns

    async def generate(self, prompt_ids, sampling: Sampling, *, session=None) -> Completion:
        turn = self.tokenizer.decode(prompt_ids).count(self.turn_marker)  # one per tool call so far
        ids = self.tokenizer.encode(self.turns[min(turn, len(self.turns) - 1)], add_special_tokens=False)
        stop = next((s for s in sampling.stop if self.tokenizer.decode(ids).endswith(s)), None)
        if stop is None:
            ids = ids + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        return Completion(ids, [-1.0] * len(ids), "stop", stop)

    async def update_weights(self, named_tensors) -> None:
        for _ in named_tensors:
            pass

    async def aclose(self) -> None:
        pass


def _scripted(tmp_path, turns: list[str], *sets: str, name: str = "run"):
    run_config = config(tmp_path, "task.budgets.max_response_tokens=200", "trainer.eval_every=0",
                        "trainer.export=false", "trainer.probe_tokens=0", *sets, name=name)  # scripted: no weights
    from agentrl.task import load_tokenizer

    return Trainer(run_config, engine=ScriptedEngine(load_tokenizer("configs/tiny_tokenizer"), turns))


CODE_TURN = "```python\nprint('\\\\boxed{' + str(6 * 7) + '}')\n```\n```output"


@pytest.mark.parametrize(("answer", "correct"), [("So it is.", 0.0), ("So it is \\boxed{42}.", 1.0)])
def test_a_boxed_answer_printed_by_the_tool_earns_nothing(tmp_path, answer, correct):
    """The program prints `\\boxed{42}` (the sandbox really runs it); only the model's own boxed answer
    counts."""
    trainer = _scripted(tmp_path, [CODE_TURN, answer], "trainer.steps=1", "task.dataset.path=" + str(
        _write_rows(tmp_path, [{"id": "q", "problem": "What is 6 * 7?", "answer": "42"}])),
                        "trainer.prompts_per_step=1")
    run = asyncio.run(trainer.run()).root
    [sample, *_] = read_jsonl(run / "samples" / "step_1.jsonl")
    assert [s["source"] for s in sample["segments"]] == ["model", "tool", "model"]
    assert "\\boxed{42}" in sample["segments"][1]["text"]  # the observation did carry it
    [metrics] = read_jsonl(run / "metrics.jsonl")
    assert metrics["reward/correct"] == correct
    assert metrics["tool/calls_per_trajectory"] == 1.0 and metrics["tool/error_rate"] == 0.0


def _write_rows(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_sandbox_killed_mid_run_gives_error_observations_and_is_restarted(tmp_path):
    def kill_at_step_2(step: int) -> None:
        if step == 2:
            service = trainer.services.managed[0]
            os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()

    # revived between steps only (the watcher, which revives within a step, is test_services.py's)
    trainer = _scripted(tmp_path, [CODE_TURN, "\\boxed{42}"], "trainer.steps=3", "services.watch_interval_s=0",
                        "services.tool_retries=1")
    trainer.on_step_start = kill_at_step_2
    run = asyncio.run(trainer.run()).root
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["tool/error_rate"] for m in metrics] == [0.0, 1.0, 0.0]
    assert [m["services/sandbox_restarts"] for m in metrics] == [0.0, 0.0, 1.0]
    assert all(m["tool/calls_per_trajectory"] == 1.0 for m in metrics)


class DigitShare:
    """A reward a tiny random model can learn in a few dozen CPU steps: the share of digits in what it
    wrote."""

    class Params(StrictModel):
        pass

    def __init__(self, params=None) -> None:
        pass

    def __call__(self, response, ground_truth, *, tool_records=()) -> RewardResult:
        digits = sum(c.isdigit() for c in response)
        return RewardResult(digits / max(len(response), 1), {"correct": float(digits > 0)})


def test_reward_rises_over_training(tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "digit_share", DigitShare)
    sets = ["task.reward.name=digit_share", "task.reward.params={}", "task.tools.format=null", "task.tools.names=[]",
            "task.budgets.max_tool_calls=0", "task.budgets.max_turns=1", "task.budgets.max_response_tokens=8",
            "task.budgets.observation_max_chars=null", "trainer.steps=30", "trainer.save_every=0",
            "trainer.eval_every=0", "trainer.export=false", "trainer.samples_per_step=0", "rollout.n=8",
            "learner.optim.lr=0.01", "trainer.prompts_per_step=4"]
    run = train(config(tmp_path, *sets)).root
    rewards = [m["reward/mean"] for m in read_jsonl(run / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.5, rewards


QUICK = ("trainer.steps=1", "trainer.eval_every=0", "trainer.export=false", "trainer.save_every=0",
         "trainer.samples_per_step=0")


@pytest.mark.parametrize(("sets", "expected"), [
    (("algo.advantage=drgrpo", "algo.loss_agg=seq_mean_token_sum_norm"), "actor/pg_loss"),
    (("algo.advantage=rloo",), "actor/pg_loss"),
    (("algo.advantage=reinforce_pp", "algo.kl.coef=0.01", "algo.kl.use=reward"), "actor/ref_kl"),
    (("algo.kl.coef=0.01", "algo.kl.use=loss"), "actor/kl_loss"),
    (("algo.tis_cap=2.0",), "actor/tis_weight"),
    (("algo.policy_loss=gspo", "algo.loss_agg=seq_mean_token_mean", "algo.clip_low=0.0003",
      "algo.clip_high=0.0004"), "actor/clip_frac"),
    (("algo.overlong.buffer_tokens=8",), "reward/shaped_mean"),
])
def test_each_algorithm_option_trains_a_step(tmp_path, sets, expected):
    run = train(config(tmp_path, *QUICK, *sets)).root
    [metrics] = read_jsonl(run / "metrics.jsonl")
    assert expected in metrics and metrics["actor/step_skipped"] == 0.0


def test_filters_drop_what_they_name_from_the_loss(tmp_path):
    """A random model never writes a code block or an answer: every trajectory has a void turn, those cut by
    the response budget included; the filters leave no loss token, and the step is skipped."""
    run = train(config(tmp_path, *QUICK, "algo.overlong.filter_truncated=true", "algo.drop_void_turns=true")).root
    [m] = read_jsonl(run / "metrics.jsonl")
    trajectories = m["batch/trajectories"]
    truncated = round(m["rollout/stop/response_budget"] * trajectories)
    assert 0 < truncated < trajectories
    assert m["batch/truncated_dropped"] == truncated
    assert m["batch/void_dropped"] == trajectories and m["rollout/void_turns/mean"] >= 1.0
    assert m["batch/loss_tokens"] == 0.0 and m["actor/step_skipped"] == 1.0


def test_dynamic_sampling_samples_again_until_groups_carry_a_signal(tmp_path, monkeypatch):
    monkeypatch.setitem(REWARDS, "digit_share", DigitShare)
    signal_sets = ("task.reward.name=digit_share", "task.reward.params={}")
    run = train(config(tmp_path, *QUICK, "algo.dynamic_sampling.enabled=true", *signal_sets, name="signal")).root
    [m] = read_jsonl(run / "metrics.jsonl")
    assert m["rollout/dynamic_sampling_rounds"] == 1.0 and m["rollout/groups_kept"] == 4.0
    assert m["rollout/informative_group_frac"] == 1.0 and m["rollout/dynamic_sampling_fallback"] == 0.0
    # the math reward gives every sample of a random model -1: no group is informative, every round runs
    run = train(config(tmp_path, *QUICK, "algo.dynamic_sampling.enabled=true",
                       "algo.dynamic_sampling.max_rounds=3", name="flat")).root
    [m] = read_jsonl(run / "metrics.jsonl")
    assert m["rollout/dynamic_sampling_rounds"] == 3.0 and m["rollout/groups_kept"] == 0.0
    assert m["rollout/informative_group_frac"] == 0.0 and m["rollout/dynamic_sampling_fallback"] == 1.0
    assert m["batch/trajectories"] == 4 * 4  # the step's usual size, not every round's groups
    assert len(read_jsonl(run / "prompt_stats.jsonl")) == 3 * 4  # every round's prompts are recorded


def test_search_r1_with_an_auto_retriever(tmp_path):
    """The Search-R1 task with the retriever started by the trainer over a BM25 index built here."""
    from tests.test_retriever_support import build_index, write_jsonl

    corpus = write_jsonl(tmp_path / "corpus.jsonl", [
        {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'}])
    build_index(corpus, tmp_path / "index", "bm25")
    rows = _write_rows(tmp_path, [{"id": "q", "question": "What is the capital of France", "golden_answers": ["Paris"]}])
    run_config = load_run_config(DEBUG, [
        f"trainer.run_dir={tmp_path / 'run'}", "logging.progress=false", *QUICK, "trainer.prompts_per_step=1",
        "task.name=search_r1_test", f"task.dataset.path={rows}", "task.dataset.fields.question=question",
        "task.dataset.fields.answer=golden_answers", "task.dataset.fields.solution=null", "task.tools.format=search_r1",
        "task.tools.names=[search]", "task.budgets.observation_max_chars=null", "task.reward.name=qa_em",
        "task.reward.params={}", "task.budgets.max_response_tokens=300", "services.retriever=auto",
        f"services.retriever_index={tmp_path / 'index'}", "task.prompt.template=Question: {question}\n",
        "trainer.probe_tokens=0"])  # a scripted engine holds no weights
    from agentrl.task import load_tokenizer

    engine = ScriptedEngine(load_tokenizer("configs/tiny_tokenizer"),
                            ["<search> capital of france </search>", "<answer> Paris </answer>"])
    engine.turn_marker = "<information>"  # Search-R1's observation
    run = asyncio.run(Trainer(run_config, engine=engine).run()).root
    [m] = read_jsonl(run / "metrics.jsonl")
    assert m["tool/calls_per_trajectory"] == 1.0 and m["tool/error_rate"] == 0.0
    assert m["reward/mean"] == 1.0 and m["rollout/stop/answered"] == 1.0


def test_a_service_that_cannot_start_fails_the_run_naming_it_and_its_log(tmp_path):
    from agentrl.config import ConfigError

    trainer = Trainer(config(tmp_path, *QUICK, "services.sandbox_args=[--workers, none]"))
    with pytest.raises(ConfigError) as e:
        asyncio.run(trainer.run())
    log = tmp_path / "run" / "logs" / "sandbox.log"
    assert "the sandbox exited while starting" in str(e.value) and str(log) in str(e.value)
    assert "--workers" in log.read_text()  # the service's own complaint is in its log
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_wandb_and_mlflow_get_every_step_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the tracking extra is not installed: pip install 'agentrl[tracking]'")
    pytest.importorskip("mlflow", reason="the tracking extra is not installed: pip install 'agentrl[tracking]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")  # W&B writes its run files locally, no network
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store: no tracking server in a test
    store = f"file:{tmp_path / 'mlruns'}"
    sets = ("trainer.eval_every=0", "trainer.export=false", "logging.wandb_project=agentrl-tests",
            f"logging.mlflow_tracking_uri={store}", "logging.mlflow_experiment=tests")
    run = train(config(tmp_path, "trainer.steps=2", *sets)).root
    ids = {t: (run / f"{t}_run_id").read_text() for t in ("wandb", "mlflow")}
    train(config(tmp_path, "trainer.steps=3", *sets))
    assert {t: (run / f"{t}_run_id").read_text() for t in ("wandb", "mlflow")} == ids
    history = MlflowClient(store).get_metric_history(ids["mlflow"].strip(), "reward/mean")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert list((run / "wandb").glob(f"offline-run-*-{ids['wandb'].strip()}"))


def test_a_tracker_configured_but_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    from agentrl.config import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"logging.wandb_project is set but wandb is not installed: pip install"):
        train(config(tmp_path, *QUICK, "logging.wandb_project=x"))
