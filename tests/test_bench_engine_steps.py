"""The rollout model of bench/bench_engine_steps.py: step costs between measured points, and the three
loops' seconds on workloads small enough to count by hand."""

from __future__ import annotations

import pytest

from bench.bench_engine_steps import fit, simulate, step_cost


def test_step_cost_interpolates_flat_below_and_extrapolates_above() -> None:
    cost = step_cost([(3, 3.0), (1, 1.0), (5, 4.0)])
    assert cost(0) == 1.0 and cost(1) == 1.0
    assert cost(2) == pytest.approx(2.0)
    assert cost(4) == pytest.approx(3.5)
    assert cost(7) == pytest.approx(5.0)  # along the last segment: +0.5 ms per sequence


def test_fit_recovers_a_line() -> None:
    a, b = fit([(1, 3.0), (2, 5.0), (4, 9.0)])
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two different batch sizes"):
        fit([(2, 1.0), (2, 3.0)])


def test_equal_turns_make_async_and_turn_sync_the_same() -> None:
    r = simulate([[5, 5, 5]] * 4, tool_ms=7.0, step=lambda b: 2.0)
    assert r["turn_sync"] == pytest.approx((3 * 5 * 2.0 + 2 * 7.0) / 1e3)
    assert r["async"] == pytest.approx(r["turn_sync"])
    assert r["plain"] == pytest.approx(15 * 2.0 / 1e3)  # no tool calls


def test_async_overlaps_what_turn_sync_waits_for() -> None:
    # constant step cost 1 ms, no tool latency: turn-synchronous pays the longer turn twice (10 + 10 steps),
    # the async loop runs both trajectories' 11 tokens side by side (11 steps)
    r = simulate([[10, 1], [1, 10]], tool_ms=0.0, step=lambda b: 1.0)
    assert r["turn_sync"] == pytest.approx(0.020)
    assert r["async"] == pytest.approx(0.011)
    assert r["plain"] == pytest.approx(0.011)


def test_per_sequence_cost_is_paid_per_sequence() -> None:
    # a step costs 1 ms per sequence in it: every loop pays exactly one ms per generated token
    lengths = [[3, 9], [7, 2], [4, 4]]
    r = simulate(lengths, tool_ms=0.0, step=lambda b: 1.0 * b)
    tokens = sum(map(sum, lengths))
    assert r["plain"] == r["async"] == r["turn_sync"] == pytest.approx(tokens / 1e3)
