"""The trainer on Ray (placement.py), against a cluster started the way users start one (`ray start --head`):
two learner ranks (gloo) and two transformers engines as actors, the debug config with the real sandbox.
The metrics are the one-process run's, checkpoints pass between the two kinds of run both ways, and a dead
rank or engine fails the run naming it, after which the run resumes from its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.learner.fsdp import free_port
from agentrl.run import load_run_config
from agentrl.trainer import Trainer, train
from tests.conftest import REPO, ray_token_mode

ray_token_mode()  # before Ray is imported
ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, cwd=REPO)
    yield f"127.0.0.1:{port}"
    if ray.is_initialized():
        ray.shutdown()
    subprocess.run([RAY, "stop", "--force"], check=False, capture_output=True)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def config(run_dir: Path, *sets: str):
    return load_run_config(REPO / "configs/debug_cpu.yaml", [f"trainer.run_dir={run_dir}", "logging.progress=false",
                                                           *sets])


def on_ray(address: str, *sets: str) -> list[str]:
    return [f"placement.ray_address={address}", "placement.learner_ranks=2", "placement.engines=2", *sets]


def steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_and_two_engines_give_the_one_process_metrics_and_checkpoints_pass_both_ways(cluster, tmp_path):
    ray_dir, local_dir = tmp_path / "ray", tmp_path / "local"
    train(config(ray_dir, *on_ray(cluster)))
    train(config(local_dir))
    on_cluster, alone = steps(ray_dir), steps(local_dir)
    assert [m["step"] for m in on_cluster] == [1, 2]
    assert [set(m) for m in on_cluster] == [set(m) for m in alone]
    assert (ray_dir / "export/config.json").exists() and (ray_dir / "checkpoints/latest").read_text().strip() == "step_2"
    train(config(ray_dir, "trainer.steps=3"))  # one process resumes the Ray run's checkpoint
    train(config(ray_dir, *on_ray(cluster, "trainer.steps=4")))  # and Ray resumes the one-process one
    assert [m["step"] for m in steps(ray_dir)] == [1, 2, 3, 4]
    assert (ray_dir / "checkpoints/latest").read_text().strip() == "step_4"


@pytest.mark.parametrize("victim", ["rank", "engine"])
def test_a_dead_actor_fails_the_run_naming_it_and_the_run_resumes(cluster, tmp_path, victim):
    import asyncio

    run_dir = tmp_path / "run"
    cfg = config(run_dir, *on_ray(cluster, "trainer.steps=3", "trainer.save_every=1", "trainer.eval_every=0"))

    def kill(step: int) -> None:
        if step == 2:
            actor = trainer.learner.ranks[1] if victim == "rank" else trainer.engine.engines[1].actor
            ray.kill(actor)

    trainer = Trainer(cfg, on_step_start=kill)

    async def run() -> None:
        try:
            await trainer.run()
        finally:
            await trainer.aclose()

    expected = (r"learner rank 1 \(a _LearnerRank actor\) died" if victim == "rank"
                else r"engine replica 1 \(an _EngineActor\) died")
    with pytest.raises(RuntimeError, match=expected):
        asyncio.run(run())
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_1"
    train(cfg)
    assert [m["step"] for m in steps(run_dir)] == [1, 2, 3]
