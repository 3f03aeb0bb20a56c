"""The quickstart's generators: seeded, held-out problems disjoint from training ones, answers right."""

from __future__ import annotations

import re

from agentrl.quickstart import arithmetic


def test_problems_are_seeded_and_the_splits_disjoint():
    assert arithmetic.problems("train", 300, seed=1) == arithmetic.problems("train", 300, seed=1)
    assert arithmetic.problems("train", 300, seed=1) != arithmetic.problems("train", 300, seed=2)
    train = {p.problem for p in arithmetic.problems("train", 2000)}
    test = {p.problem for p in arithmetic.problems("test", 200)}
    assert len(train) == 2000 and len(test) == 200 and not train & test


def test_answers_are_right_computed_from_the_text():
    """Each answer again from the numbers in the story and the operation its wording names."""
    for p in arithmetic.problems("test", 200):
        a, b, *c = (int(x) for x in re.findall(r"\d+", p.problem))
        if "gives away" in p.problem:
            expected = a * b - c[0]
        elif "more eggs" in p.problem:
            expected = a * b + c[0]
        elif "pens" in p.problem:
            expected = a + b + c[0]
        else:
            expected = a * b
        assert p.answer == expected, p


def test_traces_mix_the_tool_and_guesses():
    items = arithmetic.problems("train", 400)
    traces = arithmetic.traces(items, "Q: {question}\n", "<eos>", tool_share=0.5, seed=3)
    tool = [t for t in traces if len(t["segments"]) == 3]
    assert 150 < len(tool) < 250
    for t, p in zip(traces, items, strict=True):
        assert t["prompt"] == f"Q: {p.problem}\n"
        boxed = re.search(r"\\boxed\{(-?\d+)\}", t["segments"][-1]["text"]).group(1)
        if len(t["segments"]) == 3:
            assert t["segments"][0]["text"] == f"```python\nprint({p.expression})\n```\n```output"
            assert t["segments"][1] == {"source": "tool", "text": f"\n{p.answer}\n```\n"} and boxed == str(p.answer)
    guesses = [t for t in traces if len(t["segments"]) == 1]
    right = sum(re.search(r"\{(-?\d+)\}", t["segments"][0]["text"]).group(1) == str(p.answer)
                for t, p in zip(traces, items, strict=True) if len(t["segments"]) == 1)
    assert right < 0.3 * len(guesses)  # the guesses are mostly wrong
