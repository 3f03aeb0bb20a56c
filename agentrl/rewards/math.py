"""Math reward (the TORL recipe): the last `\\boxed{}` of the response, graded against the gold answer.

Grading runs from cheap to expensive: (1) equal after `normalize_answer`, a Qwen2.5-Math-style clean-up of
LaTeX noise; (2) two plain numbers compared exactly as fractions (a number written as a float may be off
by float noise, a rounded decimal by Qwen's tolerance: see REL_TOL); (3) math-verify (sympy) in a worker process with a hard timeout (verify_pool.py).
Grading never raises and never hangs: malformed input, a timeout, or any failure grades as wrong.
rewards/__init__.py registers `MathReward` as "math"; the trainer calls it once per trajectory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

from pydantic import Field

from agentrl.config import StrictModel
from agentrl.rewards import verify_pool
from agentrl.types import RewardResult, ToolRecord

_log = logging.getLogger(__name__)

# --- extracting the answer ----------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
_BARE_ARG = re.compile(r"[^\s$]+")


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The content of the `{...}` group opening at `text[start]` and the index past it; None when the
    group never closes. Escaped characters (`\\{`, `\\}`, `\\\\`) do not count as braces."""
    depth = 0
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def extract_boxed(text: Any) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (or bare `\\boxed 5`) in `text`; None when
    there is none or the last one never closes (a truncated response has no answer)."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _BOXED.finditer(text):  # noqa: B007 - we want the last match
        pass
    if last is None:
        return None
    i = last.end()
    while i < len(text) and text[i].isspace():
        i += 1
    if i < len(text) and text[i] == "{":
        group = _braced(text, i)
        return group[0] if group else None
    bare = _BARE_ARG.match(text, i)
    return bare.group(0) if bare else None


# --- normalising --------------------------------------------------------------------------------------

_REPLACEMENTS = [
    ("\n", " "),
    ("\\$", ""),
    ("$", ""),
    ("~", " "),
    ("\\qquad", " "),
    ("\\quad", " "),
    ("\\displaystyle", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\dbinom", "\\binom"),
    ("\\tbinom", "\\binom"),
    ("{,}", ","),
    ("\\%", "%"),
    ("°", "^\\circ"),
    ("\\degree", "^\\circ"),
    ("\\emptyset", "\\varnothing"),
    ("bmatrix", "pmatrix"),
    ("infinity", "\\infty"),
]
# Thin spaces; `(?<!\\)` spares a matrix row break `\\` followed by a space.
_SPACING = re.compile(r"(?<!\\)\\[,;: ]")
_WHITESPACE = re.compile(r"\s+")
_COMMAND_SYNONYMS = {"leq": "le", "geq": "ge", "neq": "ne", "to": "rightarrow", "gets": "leftarrow"}
_COMMAND_SYNONYM = re.compile(r"\\(" + "|".join(_COMMAND_SYNONYMS) + r")(?![a-zA-Z])")
_SIZING = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ$")
_TEXT_COMMANDS = re.compile(r"\\(?:text|textrm|textbf|textit|mbox|mathrm|mathbf|boldsymbol|mathit)\s*\{")
_TRAILING_TEXT = re.compile(r"\\(?:text|textrm|mbox|mathrm)\s*\{([^{}]*)\}\s*(?:\^\s*\{?[23]\}?)?\s*$")
# Unambiguous (one way to split any string), so that a long run of spaces costs linear time; the answer's
# whitespace is collapsed to single spaces before.
_TRAILING_WORDS = re.compile(r"(.*?[\d})]) ([a-zA-Z][a-zA-Z.]*(?: [a-zA-Z.]+)*) ?(?:\^ ?\{?[23]\}?)?")
# Units and counting words that follow a number in an answer ("5 cm", "30 degrees", "\text{ inches}").
_UNIT_WORDS = frozenset(
    """mm cm m km meter meters metre metres centimeter centimeters millimeter millimeters kilometer
    kilometers in inch inches ft foot feet yd yard yards mi mile miles sq square cubic unit units
    g gram grams kg kilogram kilograms mg lb lbs pound pounds oz ounce ounces ton tons l liter liters
    litre litres ml gallon gallons s sec second seconds min minute minutes h hr hrs hour hours day days
    week weeks month months year years mph kph degree degrees deg radian radians dollar dollars cent
    cents percent times celsius fahrenheit kelvin""".split()
)
_ASSIGNMENT = re.compile(r"\s*(?:[a-zA-Z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*=(.*)")
_MEMBERSHIP = re.compile(r"\s*[a-zA-Z]\s*\\in(?![a-zA-Z])(.*)")
_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|.", re.S)
_PROTECTED_SPACE = re.compile(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_LEADING_POINT = re.compile(r"(?<![\d.])\.(?=\d)")


def _unwrap_text(s: str) -> str:
    """`\\text{X}` -> `X` (and \\mbox, \\mathrm, \\textbf...), outermost first, until none is left."""
    for _ in range(10):  # nesting depth we care about; each pass removes one level
        out, i = [], 0
        while m := _TEXT_COMMANDS.search(s, i):
            group = _braced(s, m.end() - 1)
            if group is None:
                break
            out += [s[i : m.start()], group[0]]
            i = group[1]
        if i == 0:
            return s
        s = "".join(out) + s[i:]
    return s


def _brace_args(s: str, command: str, nargs: int) -> str:
    """Give every argument of `command` braces: `\\frac12` -> `\\frac{1}{2}`, `\\sqrt2` -> `\\sqrt{2}`,
    `\\frac\\pi2` -> `\\frac{\\pi}{2}`, recursively inside braced arguments."""
    pattern = re.compile(re.escape(command) + r"(?![a-zA-Z])")
    out, i = [], 0
    while m := pattern.search(s, i):
        out.append(s[i : m.end()])
        j = m.end()
        for _ in range(nargs):
            while j < len(s) and s[j] == " ":
                j += 1
            if command == "\\sqrt" and s.startswith("[", j) and "]" in s[j:]:
                k = s.index("]", j) + 1
                out.append(s[j:k])
                j = k
            if j >= len(s):
                break
            if s[j] == "{":
                group = _braced(s, j)
                if group is None:
                    break
                out.append("{" + _brace_args(group[0], command, nargs) + "}")
                j = group[1]
            else:
                token = _TOKEN.match(s, j).group(0)  # type: ignore[union-attr]
                out.append("{" + token + "}")
                j += len(token)
        i = j
    return "".join(out) + s[i:]


def _strip_units(s: str) -> str:
    """Drop a trailing unit: `5\\text{ cm}^2`, `20 inches`, `\\frac{1}{2}\\mbox{ inch}`. A `\\text{}` that
    starts with a space is a unit by convention (MATH's solutions write units that way)."""
    if (m := _TRAILING_TEXT.search(s)) and (prefix := s[: m.start()].strip()):
        words = m.group(1).replace(".", " ").split()
        if prefix[-1] not in "+-*/=^_({[," and (m.group(1).startswith(" ") or _all_units(words)):
            s = prefix
    if (m := _TRAILING_WORDS.fullmatch(s)) and _all_units(m.group(2).replace(".", " ").split()):
        s = m.group(1)
    return s


def _all_units(words: Iterable[str]) -> bool:
    words = list(words)
    return bool(words) and all(w.lower() in _UNIT_WORDS for w in words)


def normalize_answer(s: Any) -> str:
    """Canonical text of an answer, so that trivially different writings compare equal as strings.
    The result stays valid LaTeX (a space is kept after a command followed by a letter, as in `\\cot x`)."""
    if not isinstance(s, str):
        return ""
    for old, new in _REPLACEMENTS:
        s = s.replace(old, new)
    s = _SPACING.sub(" ", re.sub(r"(?<!\\)\\!", "", s))
    s = _WHITESPACE.sub(" ", s)
    s = _COMMAND_SYNONYM.sub(lambda m: "\\" + _COMMAND_SYNONYMS[m.group(1)], s)
    s = _SIZING.sub("", s)
    s = _DEGREES.sub("", s.strip())
    s = s.strip().rstrip(".").strip()
    s = _strip_units(s)
    s = _unwrap_text(s)
    s = _strip_units(s.replace("%", " ").strip())
    if s.count("=") == 1 and (m := _ASSIGNMENT.fullmatch(s)) and m.group(1).strip():
        s = m.group(1)  # `x = 5` -> `5`: the variable's name is not part of the answer
    if m := _MEMBERSHIP.fullmatch(s):
        s = m.group(1)  # `x \in [1, 2)` -> `[1, 2)`
    s = _brace_args(_brace_args(s, "\\frac", 2), "\\sqrt", 1)
    s = _PROTECTED_SPACE.sub("\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    s = _LEADING_POINT.sub("0.", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if re.fullmatch(r"\(([A-Za-z])\)", s):
        s = s[1]  # multiple choice: `(C)` -> `C`
    return s.rstrip(".")


# --- numbers ------------------------------------------------------------------------------------------

_DECIMAL = re.compile(r"(\d+\.?\d*|\.\d+)(?:[eE]([+-]?\d+))?")
_FRAC = re.compile(r"\\frac\{([^{}]+)\}\{([^{}]+)\}")
_SLASH = re.compile(r"([^/]+)/([^/]+)")
_POWER = re.compile(r"(?:(.+?)(?:\\times|\\cdot|\*))?(\d+(?:\.\d+)?)\^(?:\{([+-]?\d+)\}|(\d))")
_MAX_DIGITS = 2000  # bigger exact numbers are left to the worker, which can be killed
# Two numbers are equal when equal as fractions. A prediction written as a float (with a decimal point or
# an exponent: the code tool's 0.30000000000000004 for 0.3, 1.2676506002282294e+30 for 2^100) may also be
# off by float noise; one written as an exact integer or fraction may not, so 11111111101 is not
# 11111111100 and 2^100 + 1 is not 2^100. A decimal prediction of a gold that no finite decimal can write
# (1/3, 2/7) may also be off by REL_TOL: Qwen2.5-Math's (and so ToRL's) tolerance, which accepts 0.3333
# for 1/3 (but not 0.333). Unlike Qwen's grader, nothing else gets it: a gold that is an integer (AIME,
# AMC, GSM8K), a terminating decimal ($306,956.63 to the cent) or a fraction answered with a fraction is
# matched exactly, so 10001, 306987.00 and 10202/200 are not 10000, 306956.63 and 10201/200.
REL_TOL = 1e-4
FLOAT_NOISE = 1e-9


def _to_number(s: str) -> Fraction | None:
    """`s` (normalised) as an exact number when it is a plain one: 12, -0.5, 1e-3, 3/4, \\frac{3}{4},
    10^{3}, 2.5\\times10^{4}. None for anything else, including numbers too large to build cheaply."""
    if len(s) > 400:
        return None
    sign = 1
    while s[:1] in ("+", "-"):
        sign, s = (-sign if s[0] == "-" else sign), s[1:]
    if m := _DECIMAL.fullmatch(s):
        exponent = int(m.group(2) or 0)
        if abs(exponent) > _MAX_DIGITS or len(m.group(1)) > _MAX_DIGITS:
            return None
        return sign * Fraction(m.group(1)) * Fraction(10) ** exponent
    if (m := _FRAC.fullmatch(s)) or (m := _SLASH.fullmatch(s)):
        num, den = _to_number(m.group(1)), _to_number(m.group(2))
        return None if num is None or not den else sign * num / den
    if m := _POWER.fullmatch(s):
        mantissa = _to_number(m.group(1)) if m.group(1) else Fraction(1)
        base, exponent = Fraction(m.group(2)), int(m.group(3) or m.group(4))
        if mantissa is None or len(m.group(2)) * abs(exponent) > _MAX_DIGITS or (base == 0 and exponent < 0):
            return None
        return sign * mantissa * base**exponent
    return None


def _numbers_equal(pred: Fraction, gold: Fraction, pred_decimal: bool, pred_float: bool) -> bool:
    """`pred_decimal`: the prediction was written with a decimal point (a rounding, possibly);
    `pred_float`: with a decimal point or an exponent (a float, possibly carrying float noise)."""
    if pred == gold:
        return True
    if not pred_float:
        return False
    scale = max(abs(pred), abs(gold))
    if abs(pred - gold) <= FLOAT_NOISE * scale:
        return True
    return pred_decimal and not _terminates(gold) and abs(pred - gold) <= REL_TOL * scale


def _terminates(x: Fraction) -> bool:
    """Whether a finite decimal writes `x` exactly (its denominator has no prime factor but 2 and 5)."""
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _numeric_verdict(pred: str, gold: str, pred_percent: bool, gold_percent: bool) -> bool | None:
    """True/False when both answers are plain numbers, None when the question is sympy's. A percent
    sign reads both ways on its own side only: a gold of 50% also accepts 0.5, a prediction of 50% also
    matches a gold of 0.5 (but 5000 never equals 50%)."""
    p, g = _to_number(pred), _to_number(gold)
    if p is None or g is None:
        return None
    candidates = [(p, g)]
    if gold_percent:
        candidates.append((p, g / 100))
    if pred_percent:
        candidates.append((p / 100, g))
    m = _DECIMAL.fullmatch(pred.lstrip("+-"))
    decimal = m is not None and "." in pred
    written_float = "." in pred or (m is not None and m.group(2) is not None)
    return any(_numbers_equal(x, y, decimal, written_float) for x, y in candidates)


# --- equivalence and the reward -----------------------------------------------------------------------


_CLOCK = re.compile(r"\d:\d\d")
_WORD = re.compile(r"[A-Za-z]{2,}")


def _different_equations(pred: str, gold: str, timeout_s: float) -> bool | None:
    """The verdict on two equations whose left sides differ; None when the answers are not both
    equations or their left sides agree (then normalize_answer compares their right sides, dropping an
    assignment's `x =`, which is sound when the other answer names no variable: `x = 5` for `5`). Two
    assignments of different variables differ (`x = 3/2` does not answer `y = 3/2`); any other pair is
    compared whole, symbolically: `y^2 + x^2 = 25` answers `x^2+y^2=25`, `-k = 6` does not answer `k = 6`."""
    if pred.count("=") != 1 or gold.count("=") != 1:
        return None
    sides = [[normalize_answer(side) for side in x.split("=")] for x in (pred, gold)]
    if sides[0][0] == sides[1][0]:
        return None
    if all(_ASSIGNMENT.fullmatch(x) for x in (pred, gold)):
        return False
    return verify_pool.verify("=".join(sides[0]), "=".join(sides[1]), timeout_s)


def is_equiv(pred: Any, gold: Any, timeout_s: float = 5.0) -> bool:
    """Whether answer `pred` is mathematically equal to `gold`. Never raises; a timeout is a no."""
    try:
        if not isinstance(pred, str) or not isinstance(gold, str):
            return False
        if (verdict := _different_equations(pred, gold, timeout_s)) is not None:
            return verdict
        p, g = normalize_answer(pred), normalize_answer(gold)
        if not p or not g:
            return False
        if _CLOCK.search(p) or _CLOCK.search(g):  # times of day are text: sympy reads 4:30p.m as 4
            return p.lower() == g.lower()
        if p == g or (p.lower() == g.lower() and _WORD.fullmatch(p)):  # East for east; single letters keep case
            return True
        verdict = _numeric_verdict(p, g, pred_percent="%" in pred, gold_percent="%" in gold)
        if verdict is not None:
            return verdict
        return verify_pool.verify(p, g, timeout_s)
    except Exception:
        _log.warning("grading %r against %r failed; graded as wrong", pred, gold, exc_info=True)
        return False


def gold_answers(ground_truth: Any) -> list[str]:
    """One gold answer or several (any of them is right) as a list of strings; a gold written as a
    whole solution gives its last `\\boxed{}`; numbers (GSM8K) become text."""
    items = [ground_truth] if isinstance(ground_truth, (str, int, float)) else list(ground_truth or [])
    golds = []
    for item in items:
        if isinstance(item, (str, int, float)) and not isinstance(item, bool):
            text = str(item)
            golds.append((extract_boxed(text) or text) if "\\boxed" in text or "\\fbox" in text else text)
    return golds


class MathReward:
    """`correct` when the last boxed answer equals a gold answer, else `incorrect`, or `no_answer` when there
    is no boxed answer at all (unset: `incorrect`); minus `exec_error_penalty` when the response called the
    tool and a call failed."""

    class Params(StrictModel):
        correct: float = 1.0
        incorrect: float = -1.0
        no_answer: float | None = Field(None, description="the score without a boxed answer (LIMR: -1 against "
                                        "-0.5 for a wrong one); unset: incorrect")
        exec_error_penalty: float = Field(0.0, ge=0, description="subtracted when a tool call failed")
        timeout_s: float = Field(5.0, gt=0, description="limit on one sympy comparison; a timeout is wrong")

    def __init__(self, params: Params | None = None) -> None:
        self.params = params if params is not None else self.Params()

    def __call__(
        self, response: Any, ground_truth: Any, *, tool_records: Sequence[ToolRecord] = ()
    ) -> RewardResult:
        try:
            answer = extract_boxed(response)
            golds = gold_answers(ground_truth)
        except Exception:  # a ground truth of an unexpected type
            answer, golds = None, []
        has_answer = bool(answer and answer.strip())
        correct = has_answer and any(is_equiv(answer, g, self.params.timeout_s) for g in golds)
        # ToRL penalised every response whose tool output was an error or absent; we penalise only
        # a response that did call the tool and saw it fail.
        exec_error = any(not r.result.ok for r in tool_records)
        score = self.params.correct if correct else self.params.incorrect
        if not has_answer and self.params.no_answer is not None:
            score = self.params.no_answer
        if exec_error:
            score -= self.params.exec_error_penalty
        parts = {"correct": float(correct), "has_answer": float(has_answer), "exec_error": float(exec_error)}
        return RewardResult(score=score, parts=parts)
