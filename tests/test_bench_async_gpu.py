"""bench/bench_async_gpu.py's settings: the config overrides each names, and the sync row each is compared
with (the GPU run itself is in BENCHMARKS.md)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agentrl.run_config import load_run_config
from bench.bench_async_gpu import _baseline, _parse

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "debug_cpu.yaml"


def test_a_setting_names_its_mode_then_its_own_overrides() -> None:
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
