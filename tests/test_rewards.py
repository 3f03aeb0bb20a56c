"""rewards/: math answer grading (extraction, normalisation, equivalence, the worker pool) and QA EM/F1.

Every case has a known answer. The math-verify worker pool is started once for the module and shut down
at its end, where the test also checks that no worker process outlived it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.rewards import REWARDS, build_reward, params_model, verify_pool
from agentrl.rewards.math import MathReward, extract_boxed, is_equiv, normalize_answer
from agentrl.rewards.qa import QAF1, QAExactMatch, extract_answer, f1_score, normalize_text
from agentrl.types import ToolCall, ToolRecord, ToolResult


def _worker_pids() -> list[int]:
    """Our child processes that run a math-verify worker (Linux /proc)."""
    pids = []
    for children in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                if b"verify_pool" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
            except OSError:
                pass  # it exited meanwhile
    return pids


@pytest.fixture(scope="module", autouse=True)
def worker_pool():
    yield
    verify_pool.shutdown()
    assert _worker_pids() == [], "math-verify workers outlived shutdown()"


# --- equivalence: (gold, prediction) --------------------------------------------------------------------

EQUAL = [
    # fractions
    (r"\frac{1}{2}", r"\frac12"), (r"\dfrac{1}{2}", r"\frac{1}{2}"), (r"\tfrac{3}{4}", "3/4"), ("1/2", r"\frac{1}{2}"),
    (r"\frac43", r"\frac{4}{3}"), (r"\frac 59", r"\dfrac{5}{9}"), (r"\frac9{19}", r"\frac{9}{19}"),
    (r"-\frac{1}{2}", "-0.5"), (r"\frac{-1}{2}", "-1/2"), (r"\frac{270}7\text{ degrees}", r"\frac{270}{7}"),
    # decimals
    ("0.5", r"\frac{1}{2}"), (".5", "0.5"), ("0.50", "0.5"), ("2.0", "2"), (".0000672", "0.0000672"),
    (r"\dfrac{33}{100}", "0.33"), (r"\frac{1}{3}", "0.3333"), ("5.", "5"),
    ("0.3", "0.30000000000000004"), ("5", "4.999999999"),  # the code tool's float noise
    # degrees and percentages
    (r"90^\circ", "90"), (r"90^{\circ}", "90"), ("90°", "90"), ("30 degrees", "30"), (r"30\text{ degrees}", r"30^\circ"),
    (r"50\%", "50"), ("50%", r"50\%"), (r"50\%", "0.5"),
    # money, units and text
    (r"\$18.90", "18.90"), ("$5", "5"), (r"5\text{ dollars}", "5"), (r"\$32,\!348", "32348"),
    (r"15\mbox{ cm}^2", "15"), (r"864 \mbox{ inches}^2", "864"), (r"5.4 \text{ cents}", "5.4"), ("20", "20 inches"),
    (r"\text{Evelyn}", "Evelyn"), (r"\text{(C)}", "C"), (r"\text{(C)}", "(C)"), (r"\textbf{east}", r"\text{east}"),
    # intervals
    (r"[1,2)", r"[1, 2)"), (r"(-\infty, 3]", r"(-\infty,3]"), (r"x \in [-2,7]", "[-2,7]"),
    (r"\left(\frac{3}{5},\frac{8}{3}\right]", r"(\frac35, \frac83]"), (r"(-\infty, 2) \cup (3, \infty)", r"(-\infty,2)\cup(3,\infty)"),
    # tuples and ordered pairs
    (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"), ("(1,2)", "(1, 2)"), ("(6,31,-1)", "(6, 31, -1)"),
    (r"\left( \frac{3}{2}, -13 \right)", "(1.5, -13)"),
    # matrices and vectors
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"),
    (r"\begin{pmatrix} -1/3 \\ 2/3 \end{pmatrix}", r"\begin{bmatrix} -\frac{1}{3} \\ \frac{2}{3} \end{bmatrix}"),
    (r"\begin{pmatrix} -1 & 0 \\ 0 & -1 \end{pmatrix}", r"\begin{pmatrix}-1&0\\0&-1\end{pmatrix}"),
    # powers of ten, scientific notation, thousands separators
    ("1000", "10^{3}"), ("1000", "10^3"), ("1500", r"1.5\times10^{3}"), ("1000", "1e3"), ("1024", "2^{10}"),
    ("1000", "1,000"), ("10080", r"10,\!080"), (r"11,\! 111,\! 111,\! 100", "11111111100"), ("58,500", "58500"),
    # negative numbers
    ("-50", "-50"), ("-2", r"-\frac{4}{2}"), ("-2 + 7i", "7i - 2"),
    # sets and lists
    (r"\{1,2\}", r"\{2, 1\}"), (r"\{1, 2, 3\}", r"\{3,2,1\}"), ("3, 5, 7", "3,5,7"), ("1,-2", "-2, 1"),
    # roots and pi
    (r"\sqrt{2}", r"\sqrt2"), (r"2\sqrt{5}", r"\sqrt{20}"), (r"11\sqrt2", r"11\sqrt{2}"),
    (r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2"), (r"\frac{3\sqrt{3}}{4}", r"\frac{3}{4}\sqrt{3}"),
    (r"\pi", r"\pi"), (r"\frac{\pi}{3}", r"\pi/3"), (r"-\frac{\pi}{6}", r"-\frac{\pi}6"), (r"2\pi", r"2 \pi"),
    # expressions and equations
    ("p - q", "p-q"), ("p - q", "-q + p"), ("x+1", "1+x"), ("x^2+2x+1", "(x+1)^2"), ("6 - 5i", "6-5i"),
    ("x=5", "5"), ("y = 2x + 3", "2x+3"), (r"\cot x", r"\cot x"), (r"\infty", r"\infty"),
    ("x^2+y^2=25", "y^2 + x^2 = 25"), ("x^2+y^2=25", "25 = x^2 + y^2"), ("y=1+2x", "y = 2x + 1"),
    ("2^{100}", str(2**100)), ("2^{100}", "1.2676506002282294e+30"),  # a float may carry float noise
    # a base-8 numeral's subscript is notation (math-verify drops it, as graders of MATH do)
    ("52_8", "52"),
    # rounded decimals of golds no finite decimal writes; words in any case; equal left sides; clock times
    (r"\frac{1}{7}", "0.142857"), (r"\text{east}", r"\text{East}"), ("k=6", "k = 6"), ("k=6", "6"),
    (r"\text{4:30 p.m.}", "4:30 p.m."),
]

NOT_EQUAL = [
    ("2", "3"), ("0.5", "0.05"), ("x+1", "x-1"), ("-2", "2"), ("[1,2)", "(1,2)"), ("[1,2]", "[1,2)"),
    ("(1,2)", "(2,1)"), ("10000", "10001"), ("1000000", "1000001"), (r"\frac{1}{3}", "0.333"),
    (r"\frac{1}{2}", r"\frac{1}{3}"), (r"\sqrt{2}", r"\sqrt{3}"), (r"\pi", "3"), ("p - q", "q - p"),
    (r"2\sqrt{5}", r"5\sqrt{2}"), ("10^{3}", "100"), ("1,000", "1"), ("3, 5, 7", "3, 5"),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}"), (r"\{1,2\}", r"\{1,3\}"),
    ("Evelyn", "Navin"), (r"\text{(C)}", "B"), ("6-5i", "6+5i"), ("x^2", "x^3"), ("0", "1"), (r"90^\circ", "45"),
    (r"-\frac{\pi}{6}", r"\frac{\pi}{6}"), (r"\infty", r"-\infty"), ("1e3", "1e4"), ("2x+3", "2x-3"),
    ("5", ""), ("", "5"), (r"\frac{1}{2}", r"\frac{1}{2"),
    # a percent sign reads both ways on its own side only; an integer gold takes float noise, not near misses
    (r"50\%", "5000"), ("800", r"8\%"), ("70000", "70006.5"), ("204", "204.01"), ("3159.0", "3159.3"),
    # a gold that a finite decimal or a fraction writes exactly takes no tolerance
    (r"\$306,\!956.63", r"\$306,987.00"), (r"\frac{10201}{200}", r"\frac{10202}{200}"),
    (r"\frac{116050}{59049}", r"\frac{116051}{59049}"),
    # equations: two assignments name the same variable; other equations are compared whole
    (r"y = \frac{3}{2}", r"x = \frac{3}{2}"), ("k=6", "y = 6"), ("k=6", "-k=6"), ("y = 3", "x = 3"),
    ("x^2+y^2=25", "y^2 + x^2 = 26"), ("x+y=1", "x+z=1"),
    # an integer written exactly is matched exactly, however large (float noise is for floats)
    (r"11,\! 111,\! 111,\! 100", "11,111,111,101"), ("2^{100}", str(2**100 + 1)), ("1000000000", "1000000001"),
    (r"\text{4:30 p.m.}", r"\text{4:30 a.m.}"),
]


@pytest.mark.parametrize(("gold", "pred"), EQUAL)
def test_equivalent_answers_match(gold: str, pred: str) -> None:
    assert is_equiv(pred, gold)


@pytest.mark.parametrize(("gold", "pred"), NOT_EQUAL)
def test_different_answers_do_not_match(gold: str, pred: str) -> None:
    assert not is_equiv(pred, gold)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"), (r"\dfrac12", r"\frac{1}{2}"),
        (r"10,\!080", "10080"), ("(1,2)", "(1,2)"), (r"x = \frac{\pi}{2}.", r"\frac{\pi}{2}"),
        (r"\$5.00", "5.00"), (r"20\text{ cm}", "20"), (r"\cot  x", r"\cot x"), (r"\sqrt[3]2", r"\sqrt[3]{2}"),
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}"), (None, ""),
    ],
)
def test_normalize_answer(raw, normal: str) -> None:
    assert normalize_answer(raw) == normal


# --- extract_boxed ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so the answer is $\boxed{5}$.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),
        (r"\boxed{\text{(C)}} and more text", r"\text{(C)}"),
        (r"\boxed 5$ is it", "5"),
        (r"\boxed 5", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{}", ""),
        (r"\boxed{\boxed{3}}", "3"),
        ("no answer here", None),
        (r"\boxed{\frac{1}{2}", None),
        (r"\boxed{1} and a truncated \boxed{2", None),
        (r"\boxedfoo{3}", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_boxed(text, answer) -> None:
    assert extract_boxed(text) == answer


# --- MathReward ------------------------------------------------------------------------------------------


def test_math_reward_values() -> None:
    reward = MathReward()
    right = reward(r"... so $\boxed{\dfrac{1}{2}}$", "0.5")
    assert right.score == 1.0
    assert right.parts == {"correct": 1.0, "has_answer": 1.0, "exec_error": 0.0}
    wrong = reward(r"\boxed{3}", "2")
    assert wrong.score == -1.0 and wrong.parts["correct"] == 0.0 and wrong.parts["has_answer"] == 1.0
    missing = reward("I think it is 2", "2")
    assert missing.score == -1.0 and missing.parts["has_answer"] == 0.0
    limr = MathReward(MathReward.Params(correct=1.0, incorrect=-0.5, no_answer=-1.0))  # LIMR's three levels
    assert [limr(r, "2").score for r in (r"\boxed{2}", r"\boxed{3}", "it is 2", r"\boxed{}")] == [1.0, -0.5, -1.0, -1.0]


def _records(*errors: str | None) -> list[ToolRecord]:
    return [ToolRecord(1, ToolCall("python", {"code": "x"}), ToolResult("out", error)) for error in errors]


def test_math_reward_exec_error_penalty_needs_a_failed_call() -> None:
    reward = build_reward("math", {"exec_error_penalty": 0.5})
    answer = r"\boxed{4}"
    assert reward(answer, "4", tool_records=_records(None, "execution_error")).score == 0.5
    assert reward(answer, "4", tool_records=_records("execution_error", None)).parts["exec_error"] == 1.0
    assert reward(answer, "5", tool_records=_records("timeout")).score == -1.5
    assert reward(answer, "4").score == 1.0  # never called the tool
    assert reward(answer, "4", tool_records=_records(None, None, None)).score == 1.0  # called it, all fine


def test_math_reward_gold_list_and_params() -> None:
    reward = build_reward("math", {"correct": 2.0, "incorrect": 0.0})
    assert reward(r"\boxed{4}", ["3", "4"]).score == 2.0
    assert reward(r"\boxed{5}", ["3", "4"]).score == 0.0
    assert reward(r"\boxed{27}", 27.0).score == 2.0  # AMC golds are floats
    assert reward(r"\boxed{9}", r"the answer is \boxed{9}").score == 2.0


@pytest.mark.parametrize(
    ("response", "gold"),
    [
        (None, "5"), ("", "5"), (r"\boxed{", "5"), (r"\boxed{}", "5"), (r"\boxed{5}", None), (r"\boxed{5}", []),
        (r"\boxed{5}", ""), (r"\boxed{}}}{{{}", r"\frac{1}{2"), (r"\boxed{\frac{1}{2}", r"\frac{1}{2}"),
        (r"\boxed{\left(}", r"\right)"), (r"\boxed{\sqrt}", r"\frac"), (r"\boxed{5}", {"unexpected": 1}),
        ("\\boxed{" + "{" * 300 + "}" * 300 + "}", "1"), (r"\boxed{1/0}", "1"), (r"\boxed{10^{-99999}}", "0"),
    ],
)
def test_malformed_input_gets_the_failing_score(response, gold) -> None:
    assert MathReward()(response, gold).score == -1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "answer", [r"10^{10^{10^{10^{10}}}}", r"10^{10^{10}}", "1000000!", r"(10^{10})!", r"2^{2^{2^{2^{2^{2}}}}}",
               "12 cm" + "\n" * 40_000 + "6"]  # a unit, then a long run of whitespace (was quadratic: 76 s)
)
def test_pathological_answer_ends_as_wrong(answer: str) -> None:
    reward = MathReward(MathReward.Params(timeout_s=2.0))
    assert reward(rf"\boxed{{{answer}}}", "7").score == -1.0


@pytest.mark.timeout(120)
def test_a_worker_that_overruns_is_replaced() -> None:
    pool = verify_pool.VerifyPool(1)
    try:
        assert pool.verify(r"10^{10^{10^{10^{10}}}}", "1", timeout_s=0.05) is False
        assert pool.verify(r"\sqrt{8}", r"2\sqrt{2}", timeout_s=30) is True
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_dead_worker_is_replaced() -> None:
    pool = verify_pool.VerifyPool(1)
    try:
        (worker,) = list(pool._slots.queue)
        os.kill(worker.proc.pid, signal.SIGKILL)  # dies idle, e.g. at the hands of the OOM killer
        worker.proc.wait()
        assert pool.verify(r"\sqrt{8}", r"2\sqrt{2}", timeout_s=30) is True
        (replacement,) = list(pool._slots.queue)
        assert replacement is not worker and replacement.proc.poll() is None
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_every_idle_worker_dead_still_grades_right() -> None:
    pool = verify_pool.VerifyPool(2)
    try:
        workers = list(pool._slots.queue)
        for worker in workers:
            os.kill(worker.proc.pid, signal.SIGKILL)
            worker.proc.wait()
        assert pool.verify(r"\sqrt{9}", "3+0*y", timeout_s=30) is True  # the retry gets a fresh worker
        assert pool.verify(r"\sqrt{8}", r"2\sqrt{2}", timeout_s=30) is True
    finally:
        pool.close()


THREAD_CASES = [
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\frac{\pi}{2})", True),
    (r"\boxed{p-q}", "p - q", True),
    (r"\boxed{q-p}", "p - q", False),
    (r"\boxed{\sqrt{20}}", r"2\sqrt{5}", True),
    (r"\boxed{(1,2)}", "[1,2)", False),
    (r"\boxed{\{2,1\}}", r"\{1,2\}", True),
    (r"\boxed{0.5}", r"\frac12", True),
    (r"\boxed{x-1}", "x+1", False),
]


def _grade_all() -> list[bool]:
    reward = MathReward()
    return [reward(response, gold).parts["correct"] == float(expected) for response, gold, expected in THREAD_CASES]


def test_grading_from_eight_threads() -> None:
    results: dict[int, list[bool]] = {}

    def run(i: int) -> None:
        results[i] = _grade_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sorted(results) == list(range(8))
    assert all(all(r) for r in results.values())


def test_grading_inside_a_running_event_loop() -> None:
    async def main() -> tuple[list[bool], list[list[bool]]]:
        in_loop = _grade_all()  # called straight from a coroutine: no signal-based timeouts here
        in_threads = await asyncio.gather(*(asyncio.to_thread(_grade_all) for _ in range(4)))
        return in_loop, list(in_threads)

    in_loop, in_threads = asyncio.run(main())
    assert all(in_loop)
    assert all(all(r) for r in in_threads)


# --- registry --------------------------------------------------------------------------------------------


def test_registry() -> None:
    assert set(REWARDS) == {"math", "qa_em", "qa_f1", "environment"}
    assert isinstance(build_reward("math", {}), MathReward)
    assert isinstance(build_reward("qa_em", {"format_score": 0.1}), QAExactMatch)
    assert isinstance(build_reward("qa_f1", {}), QAF1)
    assert params_model("math") is MathReward.Params
    assert build_reward("math", {"timeout_s": 2}).params.timeout_s == 2.0


def test_registry_errors() -> None:
    with pytest.raises(ValueError, match=r"^unknown reward 'x'; expected one of: math, qa_em, qa_f1, environment$"):
        build_reward("x", {})
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        params_model("nope")
    with pytest.raises(ValidationError, match="corect"):
        build_reward("math", {"corect": 1.0})
    with pytest.raises(ValidationError, match="timeout_s"):
        build_reward("math", {"timeout_s": 0})


# --- QA --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>hmm</think><answer> Paris </answer>", "Paris"),
        ("<answer>Rome</answer> no, <answer>Paris</answer>", "Paris"),
        ("<answer>Rome</answer> and a truncated <answer>Par", "Rome"),
        ("no tags", None), ("</answer><answer>", None), ("", None), (None, None),
        ("<answer> Paris </answer></answer>", "Paris"),  # a stray closing tag is not content
    ],
)
def test_extract_answer(text, answer) -> None:
    assert extract_answer(text) == answer


def test_normalize_text() -> None:
    assert normalize_text("  The Eiffel-Tower, in  PARIS! ") == "eiffeltower in paris"
    assert normalize_text("An apple a day") == "apple day"


def test_qa_exact_match() -> None:
    em = QAExactMatch()
    assert em("<answer>The Eiffel Tower.</answer>", ["eiffel tower"]).score == 1.0  # one tag suffices
    assert em("<answer>eiffel tower</answer>", "The Eiffel Tower").score == 1.0  # a single string gold
    assert em("<answer>Louvre</answer>", ["eiffel tower", "louvre"]).parts == {"correct": 1.0, "has_answer": 1.0}
    assert em("<answer>Big Ben</answer>", ["eiffel tower"]).score == 0.0
    assert em("Eiffel Tower", ["eiffel tower"]).parts == {"correct": 0.0, "has_answer": 0.0}
    graded = build_reward("qa_em", {"format_score": 0.2})
    assert graded("<answer>Big Ben</answer>", ["eiffel tower"]).score == 0.2
    assert graded("Big Ben", ["eiffel tower"]).score == 0.0
    assert graded("<answer>eiffel tower</answer>", ["eiffel tower"]).score == 1.0


def test_qa_f1() -> None:
    f1 = QAF1()
    # pred {big, red, apple} vs gold {red, apple, pie}: 2 shared; precision = recall = 2/3; F1 = 2/3
    assert f1("<answer>the big red apple</answer>", ["red apple pie"]).score == pytest.approx(2 / 3)
    # "obama": P = 1/2, R = 1 -> 2/3; "president obama": P = R = 1/2 -> 1/2; the max is 2/3
    assert f1_score("Barack Obama", ["obama", "president obama"]) == pytest.approx(2 / 3)
    assert f1("<answer>An Obama</answer>", "obama").score == 1.0
    assert f1("<answer>nothing shared</answer>", ["obama"]).score == 0.0
    assert f1("no tag obama", ["obama"]).parts == {"f1": 0.0, "correct": 0.0, "has_answer": 0.0}
    assert f1("<answer></answer>", ["obama"]).score == 0.0
    assert f1(None, None).score == 0.0


def test_golds_that_normalisation_empties() -> None:
    """NQ's "A+" loses its "a" (an article) and its "+": an empty answer must not match it, "A+" must."""
    em, f1 = QAExactMatch(), QAF1()
    assert em("<answer>A+</answer>", ["A+", "AB+"]).score == 1.0 and f1("<answer>a+</answer>", ["A+"]).score == 1.0
    for empty in ("<answer></answer>", "<answer> the </answer>"):
        assert em(empty, ["A+", "AB+"]).score == 0.0 and f1(empty, ["A+"]).score == 0.0
    assert em("<answer>B+</answer>", ["A+"]).score == 0.0
