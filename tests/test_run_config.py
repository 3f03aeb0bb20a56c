"""The run config: one YAML composing the stage configs, task files inlined, settings set once."""

from __future__ import annotations

import pytest

from agentrl.config import ConfigError
from agentrl.run import load_run_config
from tests.conftest import REPO

DEBUG = REPO / "configs" / "debug_cpu.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_task_file_is_inlined_and_overridable():
    cfg = load_run_config(DEBUG, ["task.dataset.path=elsewhere.jsonl", "trainer.steps=3"])
    assert cfg.task.dataset.path == "elsewhere.jsonl" and cfg.trainer.steps == 3
    assert cfg.task.prompt.template.startswith("A conversation between User and Assistant.")  # from torl_math.yaml
    assert cfg.task.budgets.max_response_tokens == 48 and cfg.task.budgets.max_turns == 2  # merged, not replaced


def test_shared_settings_are_derived_once():
    cfg = load_run_config(DEBUG, ["rollout.temperature=0.7", "trainer.seed=5", "algo.overlong.buffer_tokens=8"])
    assert cfg.learner.temperature == 0.7
    assert cfg.rollout.seed == 5 and cfg.learner.seed == 5
    assert cfg.algo.overlong.max_tokens == 48  # the task's response budget


@pytest.mark.parametrize(("sets", "message"), [
    (["learner.temperature=0.5"], "learner.temperature (0.5) contradicts rollout.temperature (1.0)"),
    (["algo.overlong.max_tokens=100"], "algo.overlong.max_tokens (100) contradicts task.budgets.max_response_tokens (48)"),
    (["rollout.seed=3"], "rollout.seed (3) contradicts trainer.seed (0)"),
    (["rollout.top_p=0.9"], "rollout.top_p=0.9"),
    (["rollout.temperature=0"], "rollout.temperature must be > 0"),
    (["algo.overlong.buffer_tokens=60"], "exceeds the response budget"),
    (["trainer.eval_holdout=0"], "trainer.eval_every needs a validation set"),
    (["trainer.epochs=2"], "exactly one of trainer.steps or trainer.epochs"),
    (["traner.steps=2"], "--set 'traner.steps=2': unknown key 'traner'"),
])
def test_contradictions_and_bad_values_are_errors_naming_the_keys(sets, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(DEBUG, sets)
    assert message in str(e.value)
    assert str(DEBUG) in str(e.value) or str(e.value).startswith("--set")  # the file, or the --set, at fault


def test_a_resolved_config_loads_back_unchanged(tmp_path):
    from agentrl.config import write_resolved

    cfg = load_run_config(DEBUG, ["rollout.temperature=0.8", "algo.overlong.buffer_tokens=8"])
    write_resolved(cfg, tmp_path)
    assert load_run_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(name):
    import yaml

    if "data" in yaml.safe_load((REPO / "configs" / name).read_text()):  # `agentrl sft` configs (tests/test_sft.py)
        return
    assert load_run_config(REPO / "configs" / name).trainer.prompts_per_step >= 1


def test_the_recipes_keep_the_papers_settings():
    torl = load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml")
    assert (torl.trainer.prompts_per_step, torl.rollout.n, torl.learner.optim.lr, torl.algo.kl.coef) == (128, 16, 1e-6, 0.0)
    assert (torl.task.budgets.max_prompt_tokens, torl.task.budgets.max_response_tokens,
            torl.task.budgets.max_tool_calls) == (400, 3072, 1)
    ppo = load_run_config(REPO / "configs/search_r1_qwen2.5-3b.yaml")
    assert ppo.algo.advantage == "gae" and ppo.critic is not None and ppo.critic.optim.lr == 1e-5
    assert (ppo.trainer.prompts_per_step, ppo.learner.optim.lr, ppo.algo.kl.coef, ppo.task.tools.search_topk) == (
        512, 1e-6, 0.001, 3)
    assert (ppo.task.budgets.max_turns, ppo.task.budgets.max_tokens_per_turn, ppo.task.budgets.observation_max_tokens) == (
        4, 500, 500)
    grpo = load_run_config(REPO / "configs/search_r1_qwen2.5-3b_grpo.yaml")
    assert grpo.algo.advantage == "grpo" and grpo.rollout.n == 5 and grpo.algo.kl.use == "loss"


@pytest.mark.parametrize(("sets", "message"), [
    (["placement.engines=2", "placement.learner_ranks=1"], "placement.engines = placement.learner_ranks"),
    (["engine.tensor_parallel_size=2"], "placement.mode split"),
    (["learner.device=cpu"], "set learner.device cuda"),
])
def test_placement_contradictions_are_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml", sets)


def test_the_layout_places_colocated_engines_on_the_learners_gpus_and_split_ones_apart():
    from agentrl.placement import Layout

    colocated = Layout(load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml",
                                       ["placement.learner_ranks=2", "placement.engines=2"]))
    assert colocated.bundles == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert colocated.ranks == [(0, 0.5), (1, 0.5)] and colocated.engines == [(0, 0.5), (1, 0.5)]
    assert colocated.needs() == {"CPU": 4.0, "GPU": 2.0}
    split = Layout(load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml", [
        "placement.mode=split", "placement.learner_ranks=2", "placement.engines=3", "engine.tensor_parallel_size=2"]))
    assert split.ranks == [(0, 1.0), (1, 1.0)] and split.engines == [(2, 2.0), (3, 2.0), (4, 2.0)]
    assert split.needs() == {"CPU": 5.0, "GPU": 8.0}
    cpu = Layout(load_run_config(DEBUG, ["placement.learner_ranks=2", "placement.engines=2"]))
    assert cpu.needs() == {"CPU": 4.0, "GPU": 0.0} and all("GPU" not in b for b in cpu.bundles)


def test_split_engines_sharing_the_learners_gpu_take_an_nccl_host_id_and_the_socket_setting(monkeypatch):
    from agentrl.placement import SHARED_GPU_SOCKETS, _shared_gpu_nccl

    recipe = REPO / "configs/torl_qwen2.5-math-1.5b.yaml"
    shared = load_run_config(recipe, ["placement.mode=split", "placement.share_gpus=true"])
    monkeypatch.delenv("NCCL_NSOCKS_PERTHREAD", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_NTHREADS", raising=False)
    assert _shared_gpu_nccl(shared, "agentrl-engine-0")["runtime_env"]["env_vars"] == SHARED_GPU_SOCKETS | {
        "NCCL_HOSTID": "agentrl-engine-0"}
    assert _shared_gpu_nccl(shared, None)["runtime_env"]["env_vars"] == SHARED_GPU_SOCKETS  # the learner's end
    monkeypatch.setenv("NCCL_SOCKET_NTHREADS", "2")  # the environment's own setting wins
    assert _shared_gpu_nccl(shared, None)["runtime_env"]["env_vars"]["NCCL_SOCKET_NTHREADS"] == "2"
    for sets in (["placement.mode=split"], []):  # engines on GPUs of their own; colocated (CUDA IPC)
        assert _shared_gpu_nccl(load_run_config(recipe, sets), "agentrl-engine-0") == {}
