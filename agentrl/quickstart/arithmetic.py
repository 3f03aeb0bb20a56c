"""Seeded word problems a tiny model cannot solve in its head but can with the Python tool (the code
quickstart), and imperfect synthetic traces to warm-start it with SFT.

A problem multiplies 3-digit numbers and adds or takes away a third in a short story (`Problem.expression` is
the arithmetic); every answer has six digits, so that a tiny model learns to copy it from the tool's output
quickly.
Which split a problem belongs to is decided by a hash of its numbers, so the held-out split never shares a
problem with the training one, whatever the counts. `traces` writes SFT data in the trainer's dump format:
a share of them call the tool (`print(...)`, its real output, then the boxed answer), the rest answer at
once with a guess ("My guess is ...") that is usually wrong, so the warm-started model has a mixed habit for RL to sort out.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

from agentrl.quickstart import trace

TEMPLATES = [
    ("A crate holds {a} bolts. How many bolts are in {b} crates?", "{a} * {b}"),
    ("A farm packs {a} boxes of {b} eggs and {c} loose eggs. How many eggs is that?", "{a} * {b} + {c}"),
    ("A train carries {a} people on each of {b} trips. How many people is that?", "{a} * {b}"),
    ("A factory makes {a} toys a day for {b} days and {c} of them break. How many toys are left?", "{a} * {b} - {c}"),
    ("A library has {a} shelves of {b} books and gives away {c}. How many books are left?", "{a} * {b} - {c}"),
]
ANSWERS = range(100_000, 1_000_000)  # six digits: the answer is copied from the tool's output at one offset


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    expression: str
    answer: int


def _split_of(template: int, numbers: tuple[int, ...]) -> str:
    digest = hashlib.sha256(f"{template}:{numbers}".encode()).digest()
    return "test" if digest[0] < 26 else "train"  # about 10% held out


def problems(split: str, count: int, seed: int = 0) -> list[Problem]:
    """`count` distinct problems of `split` ("train" or "test"), the same for the same seed."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: expected 'train' or 'test'")
    out: list[Problem] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for template, numbers, expression, answer in _stream(seed):
        if (template, numbers) in seen or _split_of(template, numbers) != split:
            continue
        seen.add((template, numbers))
        text = TEMPLATES[template][0].format(**dict(zip("abc", numbers, strict=False)))
        out.append(Problem(f"{split}-{len(out)}", text, expression, answer))
        if len(out) == count:
            return out
    raise AssertionError("unreachable: the stream is endless")


def _stream(seed: int) -> Iterator[tuple[int, tuple[int, ...], str, int]]:
    """Templates with the 3-digit numbers they use, their expression and answer: those of six digits."""
    rng = random.Random(seed)
    while True:
        template = rng.randrange(len(TEMPLATES))
        text, expression = TEMPLATES[template]
        numbers = tuple(rng.randint(100, 999) for _ in range(text.count("{")))
        expression = expression.format(**dict(zip("abc", numbers, strict=False)))
        answer = eval(expression, {"__builtins__": {}})  # noqa: S307 - our own +, -, * of integers
        if answer in ANSWERS:
            yield template, numbers, expression, answer


def rows(split: str, count: int, seed: int = 0) -> list[dict[str, str]]:
    """The problems as dataset rows: id, problem, answer (what a task spec's dataset reads)."""
    return [{"id": p.id, "problem": p.problem, "answer": str(p.answer)} for p in problems(split, count, seed)]


def traces(items: list[Problem], prompt: str, eos: str, tool_share: float = 0.5, seed: int = 0) -> list[dict]:
    """SFT traces in the trainer's dump format for the ToRL format: `prompt` is the task's template with
    `{question}`; a share `tool_share` run `print(expression)` and box the real output, the others box a
    guess (the right answer with a digit changed, most of the time)."""
    rng = random.Random(seed)
    out = []
    for p in items:
        text = prompt.replace("{question}", p.problem)
        if rng.random() < tool_share:
            out.append(trace(p.id, text, f"```python\nprint({p.expression})\n```\n```output", f"\n{p.answer}\n```\n",
                             f"The answer is \\boxed{{{p.answer}}}.{eos}"))
        else:
            out.append(trace(p.id, text, f"My guess is \\boxed{{{_guess(p.answer, rng)}}}.{eos}"))
    return out


def _guess(answer: int, rng: random.Random) -> int:
    """A guess at `answer`: right one time in ten, else with one digit changed."""
    if rng.random() < 0.1:
        return answer
    digits = list(str(abs(answer)))
    i = rng.randrange(len(digits))
    digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
    guess = int("".join(digits))
    return -guess if answer < 0 else guess
