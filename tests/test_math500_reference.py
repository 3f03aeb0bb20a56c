"""rewards/math.py against MATH500: each reference solution's last `\\boxed{}` must grade as its answer.

A grader that fails the references is wrong about correct answers written the way MATH writes them. The
data lives beside the repository (../shared/data/math/math500.jsonl); without it the test skips.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.rewards import verify_pool
from agentrl.rewards.math import extract_boxed, is_equiv

MATH500 = Path(__file__).resolve().parents[1].parent / "shared/data/math/math500.jsonl"


@pytest.mark.timeout(600)
def test_math500_reference_solutions_grade_correct() -> None:
    if not MATH500.exists():
        pytest.skip(f"{MATH500} is absent: this test needs the shared MATH500 file beside the repository")
    rows = [json.loads(line) for line in MATH500.read_text().splitlines() if line.strip()]
    failures = []
    try:
        for row in rows:
            pred = extract_boxed(row["solution"])
            if not is_equiv(pred, row["answer"]):
                failures.append((row["unique_id"], pred, row["answer"]))
    finally:
        verify_pool.shutdown()
    for unique_id, pred, gold in failures:
        print(f"FAIL {unique_id}: pred={pred!r} gold={gold!r}")
    accuracy = 1 - len(failures) / len(rows)
    print(f"MATH500 reference accuracy: {accuracy:.2%} ({len(rows) - len(failures)}/{len(rows)})")
    assert len(rows) == 500
    assert accuracy >= 0.99, f"{len(failures)} reference solutions graded wrong: {failures[:10]}"
