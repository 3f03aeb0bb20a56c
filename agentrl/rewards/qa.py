"""QA rewards (the Search-R1 recipe): the last `<answer>...</answer>` of the response against gold answers.

`QAExactMatch` ("qa_em") is Search-R1's reward: exact match after SQuAD-style normalisation (lowercase,
no punctuation, no articles, single spaces), with an optional `format_score` for a well-formed but wrong
answer. `QAF1` ("qa_f1") is token-level F1, the max over gold answers. Both read the response only,
never the prompt, so one `<answer>` tag suffices; Search-R1 scored prompt + response, whose prompt
already holds an `<answer>` example, and had to require two. rewards/__init__.py registers both.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

from agentrl.config import StrictModel
from agentrl.types import RewardResult, ToolRecord

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_text(s: str) -> str:
    """Lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace (Search-R1, SQuAD)."""
    s = s.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def extract_answer(text: Any) -> str | None:
    """The content of the last complete `<answer>...</answer>` in `text`, stripped; None when there is
    none. Searching backwards from the last closing tag keeps this linear on any input."""
    if not isinstance(text, str):
        return None
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    end = text.find("</answer>", start)  # the pair's own closing tag: a stray second one is not content
    return text[start + len("<answer>") : end].strip()


def gold_list(ground_truth: Any) -> list[str]:
    """Gold answers as a list of strings: one string, or any iterable of them (Search-R1's `target`)."""
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, (int, float)):
        return [str(ground_truth)]
    try:
        return [str(g) for g in ground_truth if isinstance(g, (str, int, float))]
    except TypeError:
        return []


def _normalized_pair(pred: str, gold: str) -> tuple[str, str]:
    """Both answers normalised; for a gold that normalisation empties (NQ's "A+", "---"), only lowercased
    and whitespace-collapsed, so that an empty answer cannot match it (Search-R1's EM would accept one)
    and the right one still does."""
    g = normalize_text(gold)
    if g:
        return normalize_text(pred), g
    return " ".join(pred.lower().split()), " ".join(gold.lower().split())


def exact_match(pred: str, golds: list[str]) -> bool:
    return any(p == g and g for p, g in (_normalized_pair(pred, gold) for gold in golds))


def f1_score(pred: str, golds: list[str]) -> float:
    """Token-level F1 between normalised answers, the max over gold answers (SQuAD's definition; where
    either side has no tokens, 1 only when both have none, as SQuAD v2)."""
    best = 0.0
    for gold in golds:
        p, g = _normalized_pair(pred, gold)
        pred_tokens, gold_tokens = p.split(), g.split()
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens and bool(g)))
            continue
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


class QAExactMatch:
    """`correct` on an exact match; `format_score` for an answer tag with a wrong answer; else 0."""

    class Params(StrictModel):
        correct: float = 1.0
        format_score: float = 0.0

    def __init__(self, params: Params | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def __call__(
        self, response: Any, ground_truth: Any, *, tool_records: Sequence[ToolRecord] = ()
    ) -> RewardResult:
        answer = extract_answer(response)
        correct = answer is not None and exact_match(answer, gold_list(ground_truth))
        score = self.params.correct if correct else self.params.format_score if answer is not None else 0.0
        return RewardResult(
            score=score, parts={"correct": float(correct), "has_answer": float(answer is not None)}
        )


class QAF1:
    """Token-level F1 of the answer against the best gold answer; 0 without an answer tag."""

    class Params(StrictModel):
        pass

    def __init__(self, params: Params | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def __call__(
        self, response: Any, ground_truth: Any, *, tool_records: Sequence[ToolRecord] = ()
    ) -> RewardResult:
        answer = extract_answer(response)
        golds = gold_list(ground_truth)
        f1 = f1_score(answer, golds) if answer is not None else 0.0
        correct = answer is not None and exact_match(answer, golds)
        return RewardResult(
            score=f1, parts={"f1": f1, "correct": float(correct), "has_answer": float(answer is not None)}
        )
