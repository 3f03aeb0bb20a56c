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
