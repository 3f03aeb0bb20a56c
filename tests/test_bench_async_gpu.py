"""bench/bench_async_gpu.py's settings: the config overrides each names, the run config each loads before
any run, and the sync row each is compared with (the GPU run itself is in BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

from agentrl.run_config import load_run_config
from bench.bench_async_gpu import _baseline, _config, _parse
from tests.conftest import QWEN_DIR

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "debug_cpu.yaml"


def test_a_setting_names_its_mode_then_its_own_overrides(monkeypatch) -> None:
    monkeypatch.chdir(CONFIG.parents[1])  # the config names its task by a path from the repository root
    assert _parse("sync") == []
    assert _parse("async:2") == ["trainer.mode=async", "trainer.max_staleness=2"]
    assert _parse("sync+inproc,learner.token_budget=4096") == ["engine.own_process=false", "learner.token_budget=4096"]
    sets = _parse("async:1,learner.reshard_after_forward=true")
    config = load_run_config(CONFIG, sets)
    assert config.trainer.mode == "async" and config.trainer.max_staleness == 1
    assert config.learner.reshard_after_forward is True
    assert load_run_config(CONFIG, _parse("async:1")).learner.reshard_after_forward is None


@pytest.mark.parametrize("bad, named", [("async:1,foo", "'foo' is not key=value"), ("async:x", "expected sync"),
                                        ("sync+gpu", "expected sync"), ("async:1,=3", "'=3' is not key=value")])
def test_a_bad_setting_is_named_before_anything_runs(bad: str, named: str) -> None:
    with pytest.raises(SystemExit, match=named):
        _parse(bad)


def test_each_row_is_compared_with_the_sync_run_of_its_own_overrides() -> None:
    rows = [{"setting": "sync", "tokens_per_s": 10.0}, {"setting": "sync,learner.x=1", "tokens_per_s": 8.0},
            {"setting": "async:1,learner.x=1", "tokens_per_s": 12.0}]
    assert _baseline(rows, "async:1,learner.x=1") == 8.0
    assert _baseline(rows, "async:1") == 10.0
    assert _baseline(rows, "async:1,learner.y=2") == 10.0  # no sync row with those: the first sync row
    assert math.isnan(_baseline(rows[2:], "async:1"))  # no sync row at all


def test_every_settings_run_config_loads_before_a_run_and_a_bad_key_is_named(tmp_path, monkeypatch) -> None:
    if not (QWEN_DIR / "tokenizer_config.json").exists():
        pytest.skip(f"{QWEN_DIR} is absent: the bench's run config needs the real Qwen2.5 tokenizer from ../shared")
    monkeypatch.setenv("AGENTRL_TOKENIZER", str(QWEN_DIR))  # _config sets these for its process
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(tokenizer=str(QWEN_DIR), steps=3, prompts=4, n=2, shape="qwen2.5-0.5b",
                              response_tokens=64, engine_memory=0.2)
    config = _config(args, "async:1,learner.reshard_after_forward=true", tmp_path)
    assert config.trainer.mode == "async" and config.learner.reshard_after_forward is True
    assert config.engine.gpu_memory_utilization == 0.2 and config.trainer.steps == 3
    with pytest.raises(SystemExit, match="unknown key 'learner.reshard_after_forwrd'"):
        _config(args, "sync,learner.reshard_after_forwrd=true", tmp_path)
