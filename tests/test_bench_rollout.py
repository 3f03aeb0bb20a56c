"""bench/bench_rollout.py's CPU-side parts: drawn turn lengths, vLLM's step counters, and the table's
medians and per-repeat ratios (the GPU run itself is in BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from bench.bench_rollout import (
    FrontendLag,
    groups,
    lag_summary,
    sample_gauges,
    schedule,
    step_stats,
    sum_samples,
    turn_lengths,
)


def test_turn_lengths_are_seeded_and_bounded() -> None:
    uniform = turn_lengths(200, 4, 256, seed=1)
    assert uniform == turn_lengths(200, 4, 256, seed=1) and uniform != turn_lengths(200, 4, 256, seed=2)
    flat = [x for t in uniform for x in t]
    assert min(flat) >= 32 and max(flat) <= 480 and 230 < sum(flat) / len(flat) < 280
    heavy = [x for t in turn_lengths(2000, 4, 256, seed=1, dist="lognormal") for x in t]
    assert min(heavy) >= 16 and max(heavy) <= 8 * 256 and sorted(heavy)[len(heavy) // 2] < 200  # median < mean
    with pytest.raises(ValueError, match="expected one of"):
        turn_lengths(1, 1, 8, dist="pareto")


def _family(*samples):
    return SimpleNamespace(samples=[SimpleNamespace(name=n, value=v) for n, v in samples])


def test_step_counters_sum_over_engines_and_give_per_step_costs() -> None:
    before = sum_samples([_family(("vllm:iteration_tokens_total_count", 10.0), ("vllm:iteration_tokens_total_sum", 500.0)),
                          _family(("vllm:prompt_tokens_total", 100.0), ("vllm:prompt_tokens_cached_total", 0.0)),
                          _family(("vllm:something_else", 7.0))])
    after = sum_samples([_family(("vllm:iteration_tokens_total_count", 60.0), ("vllm:iteration_tokens_total_count", 50.0),
                                 ("vllm:iteration_tokens_total_sum", 10_500.0)),
                         _family(("vllm:prompt_tokens_total", 500.0), ("vllm:prompt_tokens_cached_total", 300.0)),
                         _family(("vllm:num_preemptions_total", 2.0))])
    stats = step_stats(before, after, seconds=2.0)
    assert stats == {"steps": 100, "tokens_per_step": 100.0, "ms_per_step": 20.0, "preemptions": 2,
                     "cached_prompt_share": 0.75}


def test_rows_group_by_mode_in_run_order() -> None:
    rows = [{"graphs": "default", "dist": "lognormal", "mode": m, "repeat": r, "tokens_per_s": t}
            for r in range(2) for m, t in (("plain", 100 + r), ("async", 90 + r))]
    got = groups(rows)
    assert list(got) == [("default", "lognormal", "plain"), ("default", "lognormal", "async")]
    assert [r["tokens_per_s"] for r in got[("default", "lognormal", "async")]] == [90, 91]


def test_admission_settings_rotate_between_repeats() -> None:
    modes = ["plain", "async", "turn_sync"]
    assert schedule(modes, ["50", "200@16"], 0) == [("plain", "0"), ("async", "50"), ("async", "200@16"), ("turn_sync", "0")]
    assert schedule(modes, ["50", "200@16"], 1) == [("plain", "0"), ("async", "200@16"), ("async", "50"), ("turn_sync", "0")]
    assert schedule(["async"], ["0"], 3) == [("async", "0")]


def test_gauges_are_sampled_summed_over_engines_until_cancelled() -> None:
    running = [3.0]

    def collect():
        return [_family(("vllm:num_requests_running", running[0]), ("vllm:num_requests_running", 1.0))]

    async def go() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        task = asyncio.create_task(sample_gauges({"running": SimpleNamespace(collect=collect)}, out, every_s=0))
        while len(out.get("running", [])) < 2:
            await asyncio.sleep(0)
        running[0] = 7.0
        while out["running"][-1] != 8.0:
            await asyncio.sleep(0)
        task.cancel()
        return out

    samples = asyncio.run(go())["running"]
    assert samples[:2] == [4.0, 4.0] and samples[-1] == 8.0 and set(samples) == {4.0, 8.0}


def test_frontend_lag_is_measured_from_the_engine_stamp_and_passes_outputs_through() -> None:
    calls = []
    processor = SimpleNamespace(process_outputs=lambda outputs, timestamp=None, stats=None: calls.append((outputs, stats)) or "done")
    lag = FrontendLag(SimpleNamespace(engine=SimpleNamespace(output_processor=processor)))
    now = time.monotonic()
    assert processor.process_outputs(["a"], now - 10.0, "s") == "done"
    processor.process_outputs(["b"], None)  # unstamped batches are not counted
    start = len(lag.lags_s)
    for seconds in (2.0, 1.0, 3.0):
        processor.process_outputs(["c"], time.monotonic() - seconds)
    assert calls[:2] == [(["a"], "s"), (["b"], None)] and len(lag.lags_s) == 4 and lag.lags_s[0] >= 10.0
    got = lag_summary(lag.lags_s[start:])
    assert 2000 <= got["lag_ms_mean"] < 2500 and 2000 <= got["lag_ms_p90"] < 2500 and 3000 <= got["lag_ms_max"] < 3500
    assert lag_summary(lag.lags_s[len(lag.lags_s):]) == {}
