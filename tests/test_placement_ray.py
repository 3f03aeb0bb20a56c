"""The trainer on Ray (placement.py), against a cluster started the way users start one (`ray start --head`):
two learner ranks (gloo) and two transformers engines as actors, the debug config with the real sandbox
(two replicas as actors in the first run).
The metrics are the one-process run's, checkpoints pass between the two kinds of run both ways, and a dead
rank or engine fails the run naming it, after which the run resumes from its last checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.learner.fsdp import free_port
from agentrl.run_config import load_run_config
from agentrl.trainer import Trainer, train
from tests.conftest import REPO, ray_token_mode

ray_token_mode()  # before Ray is imported
ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    port = free_port()
    # CPUs for 2 learner ranks, 2 engines and 2 sandbox actors
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=6", "--include-dashboard=false",
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
    # the sandboxes too are actors here, two of them, behind a token
    train(config(ray_dir, *on_ray(cluster, "services.on_ray=true", "services.sandbox_replicas=2")))
    train(config(local_dir))
    on_cluster, alone = steps(ray_dir), steps(local_dir)
    assert [m["step"] for m in on_cluster] == [1, 2]
    assert [set(m) for m in on_cluster] == [set(m) for m in alone]
    assert (ray_dir / "export/config.json").exists() and (ray_dir / "checkpoints/latest").read_text().strip() == "step_2"
    train(config(ray_dir, "trainer.steps=3"))  # one process resumes the Ray run's checkpoint
    train(config(ray_dir, *on_ray(cluster, "trainer.steps=4")))  # and Ray resumes the one-process one
    assert [m["step"] for m in steps(ray_dir)] == [1, 2, 3, 4]
    assert (ray_dir / "checkpoints/latest").read_text().strip() == "step_4"


def test_asynchronous_training_in_split_mode_keeps_the_staleness_bound_and_tags_every_segment(cluster, tmp_path):
    """Asynchronous training on Ray, engines apart from the learner's ranks: rollout goes on over the
    engine actors while the two ranks train, every model segment carries the version that sampled it, and
    no trained token is more than max_staleness versions behind the learner."""
    run_dir = tmp_path / "run"
    train(config(run_dir, *on_ray(cluster, "placement.mode=split", "trainer.steps=3", "trainer.mode=async",
                                  "trainer.max_staleness=1", "trainer.chunk_tokens=8", "trainer.samples_per_step=16")))
    metrics = steps(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["async/staleness_max"] <= 1 and m["async/dropped_stale"] == 0
    assert metrics[0]["async/staleness_max"] == 0  # the first step's groups: all sampled by the initial weights
    for step in (1, 2, 3):
        rows = [json.loads(line) for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16
        for row in rows:
            versions = [s["version"] for s in row["segments"] if s["source"] == "model"]
            assert versions and versions == sorted(versions)  # a trajectory spanning a push: the older first
            assert step - 2 <= min(versions) and max(versions) <= step - 1
    assert (run_dir / "checkpoints/latest").read_text().strip() == "step_3"


def test_lora_on_ray_trains_the_adapter_on_two_ranks_and_pushes_it_alone_to_both_engines(cluster, tmp_path):
    from agentrl.build import build_lm
    from agentrl.learner import lora

    run_dir = tmp_path / "run"
    cfg = config(run_dir, *on_ray(cluster, "model.lora.rank=4", "model.lora.alpha=8", "trainer.eval_every=0",
                                  "learner.optim.lr=0.01"))
    adapter_bytes = 4 * sum(p.numel() for n, p in lora.add_lora(build_lm(cfg), cfg.model.lora).named_parameters()
                            if lora.is_adapter(n))
    train(cfg)
    metrics = steps(run_dir)
    assert [m["sync/bytes"] for m in metrics] == [adapter_bytes] * 2  # the adapter, gathered from both ranks
    assert all(m["sync/probe_gap"] < 1e-4 for m in metrics)  # both engines probed after each push
    assert (run_dir / "export/adapter/adapter_config.json").exists()


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


def test_services_on_ray_run_in_actors_bound_to_their_node_behind_a_token(cluster, tmp_path):
    import asyncio

    import httpx

    from agentrl.run_config import ServicesConfig
    from agentrl.services import Services
    from agentrl.tools import build_tools
    from agentrl.types import ToolCall

    if not ray.is_initialized():
        ray.init(address=cluster)
    config = ServicesConfig(on_ray=True, sandbox_replicas=2, sandbox_args=["--workers", "1"])
    with Services(["python"], config, tmp_path) as services:
        urls = services.urls["python"]
        node = ray.util.get_node_ip_address()
        assert len(set(urls)) == 2 and all(httpx.URL(u).host == node for u in urls)
        assert services.sandbox_token  # generated: the sandboxes listen off loopback
        refused = httpx.post(urls[0] + "/run_code", json={"code": "print(1)", "language": "python"}, timeout=30)
        assert refused.status_code == 401
        tool = build_tools(services.urls, sandbox_token=services.sandbox_token)["python"]

        async def run() -> list:
            try:
                return [await tool.call(ToolCall("python", {"code": "print(6 * 7)"})) for _ in range(4)]
            finally:
                await tool.aclose()

        results = asyncio.run(run())
    assert [(r.error, r.text.strip()) for r in results] == [(None, "42")] * 4
    assert {p.name for p in tmp_path.glob("*.log")} == {"sandbox-0.log", "sandbox-1.log"}


def test_a_cluster_too_small_for_the_actors_is_an_error_naming_both(cluster, tmp_path):
    from agentrl.config import ConfigError
    from agentrl.ray_placement import Placement

    with pytest.raises(ConfigError, match=r"need 10 CPUs and 0 GPUs \(8 learner ranks, 2 engines.*the Ray cluster has "
                                          r"6 CPUs and 0 GPUs"):
        Placement(config(tmp_path, *on_ray(cluster, "placement.learner_ranks=8")))
