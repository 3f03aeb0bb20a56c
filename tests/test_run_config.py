"""The run config: one YAML composing the stage configs, task files inlined, settings set once."""

from __future__ import annotations

import pytest

from agentrl.config import ConfigError
from agentrl.run_config import load_run_config
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


def test_set_task_names_another_task_file_whose_keys_later_sets_change():
    cfg = load_run_config(REPO / "configs/quickstart_code.yaml",
                          ["task.budgets.max_turns=3", "task=examples/calculator.yaml", "task.dataset.path=x.jsonl"])
    assert cfg.task.name == "calculator" and cfg.task.tools.functions[0].name == "python"
    assert cfg.task.dataset.path == "x.jsonl" and cfg.task.budgets.max_turns == 3  # applied after the file
    quoted = load_run_config(REPO / "configs/quickstart_code.yaml", ["task='examples/calculator.yaml'"])
    assert quoted.task.name == "calculator"
    assert load_run_config(DEBUG, ["eval_task=null", "trainer.eval_holdout=4"]).eval_task is None


def test_shared_settings_are_derived_once():
    cfg = load_run_config(DEBUG, ["rollout.temperature=0.7", "trainer.seed=5", "algo.overlong.buffer_tokens=8"])
    assert cfg.learner.temperature == 0.7
    assert cfg.rollout.seed == 5 and cfg.learner.seed == 5
    assert cfg.algo.overlong.max_tokens == 48  # the task's response budget
    drgrpo = load_run_config(DEBUG, ["algo.advantage=drgrpo", "algo.loss_agg=seq_mean_token_sum_norm"])
    assert drgrpo.algo.loss_norm_tokens == 48  # Dr.GRPO's constant: the response budget, not a batch's longest
    assert load_run_config(DEBUG, ["algo.loss_agg=seq_mean_token_sum_norm", "algo.loss_norm_tokens=4096"]
                           ).algo.loss_norm_tokens == 4096
    assert load_run_config(DEBUG, ["algo.advantage=gae", "algo.kl.coef=0.01", "algo.kl.use=reward"]).algo.kl.estimator == "k1"
    assert load_run_config(DEBUG, ["algo.kl.coef=0.01"]).algo.kl.estimator == "k3"


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
    (["rollout.n=1"], "algo.advantage=grpo compares each sample with the others of its prompt's group, so rollout.n "
                      "must be at least 2 (it is 1)"),
    (["rollout.n=1", "algo.advantage=rloo"], "algo.advantage=rloo"),
    (["model.lora.rank=8", "engine.kind=vllm", "engine.sleep_level=2"], "engine.sleep_level 2 drops the engine's "
                                                                          "weights"),
    (["model.lora.rank=1024", "engine.kind=vllm"], "model.lora.rank (1024): vLLM serves adapters of rank 512 at most"),
    (["model.lora.rank=8", "learner.lora.rank=16"], "learner.lora"),
    (["model.lora.rank=0"], "model.lora.rank"),
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
    """Each recipe resolved as a run sees it (after every derivation), against its paper's script."""
    torl = load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml")
    assert (torl.trainer.prompts_per_step, torl.rollout.n, torl.rollout.temperature, torl.trainer.mini_batches,
            torl.trainer.ppo_epochs, torl.trainer.steps) == (128, 16, 1.0, 1, 1, 1000)
    assert (torl.learner.optim.lr, torl.learner.optim.warmup_steps, torl.learner.optim.schedule,
            torl.learner.optim.weight_decay, torl.learner.optim.grad_clip) == (1e-6, 0, "constant", 0.01, 1.0)
    assert (torl.algo.advantage, torl.algo.kl.coef, torl.algo.entropy_coef, torl.algo.clip_low, torl.algo.clip_high,
            torl.algo.needs_reference) == ("grpo", 0.0, 0.0, 0.2, 0.2, False)
    assert (torl.task.budgets.max_prompt_tokens, torl.task.budgets.max_response_tokens, torl.task.budgets.max_tool_calls,
            torl.task.budgets.max_turns, torl.task.budgets.observation_max_chars) == (390, 3072, 1, 2, 256)

    ppo = load_run_config(REPO / "configs/search_r1_qwen2.5-3b.yaml")
    assert ppo.algo.advantage == "gae" and ppo.rollout.n == 1 and (ppo.algo.gamma, ppo.algo.lam) == (1.0, 1.0)
    assert (ppo.algo.kl.coef, ppo.algo.kl.use, ppo.algo.kl.estimator) == (0.001, "reward", "k1")
    assert (ppo.algo.value_clip, ppo.algo.entropy_coef, ppo.algo.clip_low, ppo.algo.clip_high) == (0.5, 0.001, 0.2, 0.2)
    assert (ppo.learner.optim.lr, ppo.learner.optim.warmup_steps) == (1e-6, 286)  # int(0.285 * 1005) trainer steps
    assert ppo.critic is not None and (ppo.critic.optim.lr, ppo.critic.optim.warmup_steps) == (1e-5, 15)  # 0.015
    assert (ppo.trainer.steps, ppo.trainer.prompts_per_step, ppo.trainer.mini_batches, ppo.trainer.eval_every,
            ppo.task.tools.search_topk) == (1005, 512, 2, 100, 3)
    assert (ppo.task.budgets.max_turns, ppo.task.budgets.max_tool_calls, ppo.task.budgets.max_tokens_per_turn,
            ppo.task.budgets.observation_max_tokens, ppo.task.budgets.max_prompt_tokens) == (5, 4, 500, 500, 2048)
    assert ppo.task.budgets.max_context_tokens >= 2048 + ppo.task.budgets.max_response_tokens == 2048 + 4500

    grpo = load_run_config(REPO / "configs/search_r1_qwen2.5-3b_grpo.yaml")
    assert (grpo.algo.advantage, grpo.rollout.n, grpo.critic) == ("grpo", 5, None)
    assert (grpo.algo.kl.coef, grpo.algo.kl.use, grpo.algo.kl.estimator, grpo.algo.entropy_coef) == (
        0.001, "loss", "k3", 0.001)
    assert (grpo.learner.optim.lr, grpo.learner.optim.warmup_steps) == (1e-6, 286)
    assert (grpo.trainer.steps, grpo.trainer.prompts_per_step, grpo.trainer.mini_batches) == (1005, 512, 10)  # 2560 / 256

    limr = load_run_config(REPO / "configs/limr_qwen2.5-math-7b.yaml")
    assert limr.model.path == "Qwen/Qwen2.5-Math-7B" and limr.task.dataset.path == "data/limr.jsonl"
    assert (limr.trainer.prompts_per_step, limr.rollout.n, limr.rollout.temperature) == (1024, 8, 1.2)
    assert limr.trainer.prompts_per_step * limr.rollout.n // limr.trainer.mini_batches == 256  # training batch 256
    assert (limr.algo.advantage, limr.algo.gamma, limr.algo.lam, limr.algo.value_clip) == ("gae", 1.0, 0.95, 0.2)
    assert (limr.algo.kl.coef, limr.algo.kl.use, limr.algo.kl.estimator) == (0.01, "reward", "k1")
    assert limr.critic is not None and (limr.learner.optim.lr, limr.critic.optim.lr) == (5e-7, 9e-6)
    assert limr.learner.optim.betas == limr.critic.optim.betas == (0.9, 0.95)
    assert (limr.task.budgets.max_prompt_tokens, limr.task.budgets.max_response_tokens, limr.task.tools.format) == (
        1024, 3072, None)
    assert limr.task.reward.params == {"correct": 1.0, "incorrect": -0.5, "no_answer": -1.0}
    full = load_run_config(REPO / "configs/limr_qwen2.5-math-7b.yaml",
                           ["name=limr_full", "task.dataset.path=data/math.8k.json", "trainer.steps=175"])
    assert full.task.dataset.path == "data/math.8k.json" and full.trainer.steps == 175  # the README's first run


@pytest.mark.parametrize(("sets", "message"), [
    (["placement.engines=2", "placement.learner_ranks=1"], "placement.engines = placement.learner_ranks"),
    (["engine.tensor_parallel_size=2"], "placement.mode split"),
    (["learner.device=cpu"], "set learner.device cuda"),
])
def test_placement_contradictions_are_errors(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(REPO / "configs/torl_qwen2.5-math-1.5b.yaml", sets)


def test_the_layout_places_colocated_engines_on_the_learners_gpus_and_split_ones_apart():
    from agentrl.ray_placement import Layout

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
    from agentrl.ray_placement import SHARED_GPU_SOCKETS, _shared_gpu_nccl

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


@pytest.mark.parametrize(("sets", "expected"), [
    (["engine.kind=hf"], "tensors"),
    (["engine.kind=vllm", "learner.device=cuda"], "ipc"),
    (["engine.kind=vllm", "learner.device=cuda", "model.lora.rank=8"], "tensors"),  # an adapter goes through the host
    (["engine.kind=hf", "placement.learner_ranks=2"], "bytes"),
    (["engine.kind=vllm", "learner.device=cuda", "placement.learner_ranks=2", "placement.engines=2"], "ipc"),
    (["engine.kind=vllm", "learner.device=cuda", "placement.mode=split"], "nccl"),
    (["engine.kind=vllm", "learner.device=cuda", "placement.mode=split", "model.lora.rank=8"], "bytes"),
])
def test_the_weight_transport_follows_the_placement_and_lora(sets, expected):
    from agentrl.weight_sync import transport

    assert transport(load_run_config(DEBUG, sets)) == expected


@pytest.mark.parametrize(("sets", "engine_named"), [
    (["engine.kind=vllm", "trainer.mode=async"], "async mode"),  # awake while the learner trains
    (["engine.kind=vllm", "engine.sleep_level=0"], "engine.sleep_level 0"),
    (["engine.kind=vllm"], None),  # asleep while the learner trains: its share is free then
    (["engine.kind=vllm", "learner.device=cuda", "placement.mode=split", "trainer.mode=async"], None),  # own GPUs
    (["engine.kind=hf", "trainer.mode=async"], None),
])
def test_out_of_memory_advice_names_the_settings_that_hold_the_memory(sets, engine_named):
    cfg = load_run_config(DEBUG, [*sets, "engine.gpu_memory_utilization=0.45", "learner.token_budget=4096"])
    advice = cfg.memory_advice()
    assert "learner.token_budget (4096)" in advice and "learner.activation_checkpointing: true" in advice
    assert ("engine.gpu_memory_utilization (0.45)" in advice) == (engine_named is not None)
    if engine_named:
        assert f"({engine_named})" in advice
    kept = load_run_config(DEBUG, ["learner.activation_checkpointing=true", "learner.logprob_keep_logits=true"])
    assert "activation_checkpointing" not in kept.memory_advice() and "logprob_keep_logits: false" in kept.memory_advice()


def test_an_out_of_memory_error_from_an_actor_gets_the_advice_by_its_message():
    cfg = load_run_config(DEBUG, [])
    carried, other = RuntimeError("ray: torch.OutOfMemoryError: CUDA out of memory. Tried"), RuntimeError("not finite")
    cfg.note_out_of_memory(carried)
    cfg.note_out_of_memory(other)
    assert carried.__notes__ == [cfg.memory_advice()] and not hasattr(other, "__notes__")
