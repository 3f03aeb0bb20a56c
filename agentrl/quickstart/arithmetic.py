"""Seeded word problems a tiny model cannot solve in its head but can with the Python tool (the code
quickstart), and imperfect synthetic traces to warm-start it with SFT.

A problem multiplies and adds 3-4-digit numbers in a short story (`Problem.expression` is the arithmetic).
Which split a problem belongs to is decided by a hash of its numbers, so the held-out split never shares a
problem with the training one, whatever the counts. `traces` writes SFT data in the trainer's dump format:
a share of them call the tool (`print(...)`, its real output, then the boxed answer), the rest answer at
once with a guess that is usually wrong, so the warm-started model has a mixed habit for RL to sort out.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

TEMPLATES = [
    ("A warehouse has {a} crates with {b} bolts in each crate. How many bolts are there in all?", "{a} * {b}"),
    ("A farm packs {a} boxes of {b} eggs and then {c} more eggs. How many eggs are packed?", "{a} * {b} + {c}"),
    ("A train carries {a} people on each of {b} trips. How many people does it carry?", "{a} * {b}"),
    ("A shop sold {a} pens on Monday and {b} pens on Tuesday, and {c} pens on Wednesday. How many pens did it "
     "sell?", "{a} + {b} + {c}"),
    ("A library has {a} shelves with {b} books each, and gives away {c} books. How many books are left?",
     "{a} * {b} - {c}"),
]


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    expression: str
    answer: int


def _split_of(numbers: tuple[int, ...], template: int) -> str:
    digest = hashlib.sha256(f"{template}:{numbers}".encode()).digest()
    return "test" if digest[0] < 26 else "train"  # about 10% held out


def problems(split: str, count: int, seed: int = 0) -> list[Problem]:
    """`count` distinct problems of `split` ("train" or "test"), the same for the same seed."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: expected 'train' or 'test'")
    out: list[Problem] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for template, numbers in _stream(seed):
        if (template, numbers) in seen or _split_of(numbers, template) != split:
            continue
        seen.add((template, numbers))
        text, expression = TEMPLATES[template]
        values = dict(zip("abc", numbers, strict=False))
        expr = expression.format(**values)
        answer = eval(expr, {"__builtins__": {}})  # noqa: S307 - our own +, -, * of integers
        out.append(Problem(f"{split}-{len(out)}", text.format(**values), expr, answer))
        if len(out) == count:
            return out
    raise AssertionError("unreachable: the stream is endless")


def _stream(seed: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    rng = random.Random(seed)
    while True:
        template = rng.randrange(len(TEMPLATES))
        yield template, (rng.randint(100, 9999), rng.randint(100, 9999), rng.randint(10, 999))


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
            segments = [{"source": "model", "text": f"```python\nprint({p.expression})\n```\n```output"},
                        {"source": "tool", "text": f"\n{p.answer}\n```\n"},
                        {"source": "model", "text": f"The answer is \\boxed{{{p.answer}}}.{eos}"}]
        else:
            segments = [{"source": "model", "text": f"The answer is \\boxed{{{_guess(p.answer, rng)}}}.{eos}"}]
        out.append({"id": p.id, "prompt": text, "segments": segments})
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
