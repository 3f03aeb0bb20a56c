"""Evaluation: pass@k and maj@k against hand-computed values, the benchmarks' loaders, `agentrl eval`'s
outputs and resume, through the real rollout loop and rewards with a scripted engine."""

from __future__ import annotations

import asyncio
import json
from fractions import Fraction
from pathlib import Path

import pytest

from agentrl.config import ConfigError
from agentrl.engine import Completion
from agentrl.eval import run as eval_run
from agentrl.eval.datasets import BENCHMARKS, resolve
from agentrl.eval.evaluate import majority_correct, pass_at_k, summarize
from agentrl.eval.run import run_eval
from agentrl.task import Task, load_task, load_tokenizer
from tests.conftest import REPO, SHARED


@pytest.mark.parametrize(("correct", "expected"), [
    (0, [0, 0, 0, 0]), (1, [Fraction(1, 4), Fraction(1, 2), Fraction(3, 4), 1]),
    (2, [Fraction(1, 2), Fraction(5, 6), 1, 1]), (4, [1, 1, 1, 1])])
def test_pass_at_k_is_the_unbiased_estimator(correct, expected):
    assert [pass_at_k(4, correct, k) for k in (1, 2, 3, 4)] == pytest.approx([float(e) for e in expected])


def test_majority_vote_ties_go_to_the_answer_given_first():
    assert majority_correct(["5", "7"], [True, False])  # 1-1: "5" came first
    assert not majority_correct(["8", "9"], [False, True])
    assert majority_correct(["8", "9", "9"], [False, True, True])
    assert not majority_correct([None, None], [False, False])  # nobody voted
    assert majority_correct([None, "3", "4", "4"], [False, True, False, False]) is False  # 4 wins 2-1


# (prompt id, gold, the answers of samples 0..3): a hand-computed table
TABLE = {"q1": ("1", ["1", "1", "2", "3"]), "q2": ("5", ["5", "7", "7", "5"]), "q3": ("9", ["8", "9", "9", "8"]),
         "q4": ("4", [None, None, None, None])}
# per prompt: correct count; maj@1..4
EXPECTED = {"q1": (2, [1, 1, 1, 1]), "q2": (2, [1, 1, 0, 1]), "q3": (2, [0, 0, 1, 0]), "q4": (0, [0, 0, 0, 0])}


def _expected_metrics() -> dict[str, float]:
    out = {"pass@1": sum(c for c, _ in EXPECTED.values()) / 16}
    for k in (1, 2, 3, 4):
        out[f"pass@{k}"] = sum(pass_at_k(4, c, k) for c, _ in EXPECTED.values()) / 4
        out[f"maj@{k}"] = sum(m[k - 1] for _, m in EXPECTED.values()) / 4
    return out


class TableEngine:
    """Writes each sample's answer from TABLE, by the trajectory's session key (prompt id / sample)."""

    max_context_tokens = None

    def __init__(self, tokenizer, fail_after: int | None = None) -> None:
        self.tokenizer, self.calls, self.fail_after = tokenizer, 0, fail_after

    async def generate(self, prompt_ids, sampling, *, session=None) -> Completion:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("interrupted")
        prompt_id, sample = session.rsplit("/", 1)
        answer = TABLE[prompt_id][1][int(sample)]
        text = f"So it is \\boxed{{{answer}}}." if answer is not None else "I do not know."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop", None)

    async def aclose(self) -> None:
        pass


@pytest.fixture
def data_dir(tmp_path) -> Path:
    rows = [{"problem": f"Problem {pid}?", "answer": gold, "solution": f"\\boxed{{{gold}}}", "unique_id": pid}
            for pid, (gold, _) in TABLE.items()]
    (tmp_path / "math").mkdir()
    (tmp_path / "math" / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _run(tmp_path, data_dir, engine, out="out") -> dict:
    spec = load_task(REPO / "tasks" / "torl_math.yaml").spec
    return asyncio.run(run_eval(spec=spec, benchmarks="math500", engine=engine, tokenizer=engine.tokenizer,
                                out=tmp_path / out, n=4, temperature=1.0, data_dir=str(data_dir), no_tools=True,
                                progress=False))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(REPO / "configs" / "tiny_tokenizer"))


def test_every_reported_metric_equals_the_hand_computed_one(tmp_path, data_dir, tok):
    results = _run(tmp_path, data_dir, TableEngine(tok))["math500"]
    for key, value in _expected_metrics().items():
        assert results[key] == pytest.approx(value), key
    assert results["prompts"] == 4 and results["samples"] == 16
    assert results["stop/eos"] == 1.0 and results["tool_call_rate"] == 0.0 and results["turns"] == 1.0
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "math500.samples.jsonl").read_text().splitlines()]
    q2 = sorted((r for r in records if r["prompt_id"] == "q2"), key=lambda r: r["sample"])
    assert [r["answer"] for r in q2] == ["5", "7", "7", "5"] and [r["correct"] for r in q2] == [True, False, False, True]
    assert q2[0]["segments"][0]["source"] == "model" and "\\boxed{5}" in q2[0]["segments"][0]["text"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["results"]["math500"] == results and saved["config"]["n"] == 4
    table = (out / "results.md").read_text()
    assert table.startswith("| benchmark | prompts | pass@1 | pass@4 | maj@4 |") and "| math500 | 4 | 0.375 |" in table


def test_an_interrupted_run_resumes_to_the_same_results(tmp_path, data_dir, tok, monkeypatch):
    whole = _run(tmp_path, data_dir, TableEngine(tok), out="whole")
    monkeypatch.setattr(eval_run, "CHUNK_PROMPTS", 1)  # one prompt's 4 samples per chunk
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(tmp_path, data_dir, TableEngine(tok, fail_after=9), out="part")  # 2 prompts done, the 3rd cut
    lines = (tmp_path / "part" / "math500.samples.jsonl").read_text().splitlines()
    assert len(lines) == 8
    resumed_engine = TableEngine(tok)
    resumed = _run(tmp_path, data_dir, resumed_engine, out="part")
    assert resumed_engine.calls == 8  # only the two prompts not yet done
    assert resumed == whole
    assert (json.loads((tmp_path / "part" / "results.json").read_text())["results"]
            == json.loads((tmp_path / "whole" / "results.json").read_text())["results"])


def _write(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


FIXTURES = {  # each benchmark's local file, in its own format, and the ground truth it must give
    "math500": ([{"problem": "p", "answer": "\\frac{1}{2}", "solution": "\\boxed{\\frac12}", "unique_id": "a"}], "\\frac{1}{2}"),
    "aime24": ([{"id": 60, "problem": "p", "answer": "204", "solution": "s"}], "204"),
    "aime25": ([{"question": "p", "answer": "70"}], "70"),
    "amc23": ([{"id": 0, "problem": "p", "answer": 27.0}], "27.0"),
    "gsm8k": ([{"question": "p", "answer": "Janet sells 9 eggs.\n#### 18"}], "18"),
    "olympiadbench": ([{"id": 1606, "question": "p", "final_answer": ["2"]}], ["2"]),
    "minerva": ([{"problem": "p", "solution": "so \\boxed{1.6} cm", "idx": 0}], "1.6"),
    "nq": ([{"question": "when", "answer": ["14 December 1972", "December 1972"]}], ["14 December 1972", "December 1972"]),
    "hotpotqa": ([{"question": "same?", "answer": "yes"}], "yes"),
    "bamboogle": ([{"question": "who", "answer": ["james madison"]}], ["james madison"]),
    "triviaqa": ([{"question": "q", "answer": ["a"]}], ["a"]),
    "popqa": ([{"question": "q", "answer": ["a"]}], ["a"]),
    "2wiki": ([{"question": "q", "answer": ["a"]}], ["a"]),
    "musique": ([{"question": "q", "answer": ["a"]}], ["a"]),
}


def test_every_benchmark_loads_from_its_local_format(tmp_path):
    assert set(FIXTURES) == set(BENCHMARKS)
    for name, (rows, _gold) in FIXTURES.items():
        _write(tmp_path / BENCHMARKS[name].local.path, rows)
    spec = load_task(REPO / "tasks" / "torl_math.yaml").spec
    for bench, dataset in resolve(",".join(FIXTURES), tmp_path, None):
        [row] = Task(spec.model_copy(update={"dataset": dataset})).rows()
        assert row.ground_truth == FIXTURES[bench.name][1], bench.name


def test_bad_names_and_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown benchmark 'math5000'; expected one of: math500, aime24"):
        resolve("math5000", None, None)
    with pytest.raises(ConfigError, match="benchmark aime25 expects the file math/aime25.jsonl there"):
        resolve("aime25", tmp_path, None)
    with pytest.raises(ConfigError, match="amc23 has no hub copy with known fields; pass --data-dir"):
        resolve("amc23", None, None)
    _write(tmp_path / "math" / "aime25.jsonl", [{"problem": "p", "answer": "70"}])  # `question` expected
    [(_, dataset)] = resolve("aime25", tmp_path, None)
    spec = load_task(REPO / "tasks" / "torl_math.yaml").spec
    with pytest.raises(ConfigError, match="dataset.fields.question: .* has no field 'question'; it has: answer, problem"):
        Task(spec.model_copy(update={"dataset": dataset})).rows()


def test_summarize_refuses_a_prompt_with_missing_samples():
    records = [{"prompt_id": "a", "sample": 0, "correct": True, "answer": "1", "score": 1.0, "stop_reason": "eos",
                "turns": 1, "tool_calls": 0, "tool_errors": 0, "response_tokens": 3}]
    with pytest.raises(ValueError, match="prompt a: samples \\[0\\], expected 0..1"):
        summarize(records, 2)


# --- the real files: grading their own reference answers must agree with them -------------------------

REFERENCE = {"math500": 0.99, "gsm8k": 1.0, "aime24": 1.0, "aime25": 1.0, "amc23": 1.0, "olympiadbench": 1.0,
             "minerva": 1.0}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_the_real_files_reference_answers_grade_as_correct(name):
    from agentrl.rewards import build_reward
    from agentrl.rewards.math import extract_boxed

    if not (SHARED / BENCHMARKS[name].local.path).exists():
        pytest.skip(f"{SHARED}: the shared benchmark files are absent")
    spec = load_task(REPO / "tasks" / "torl_math.yaml").spec
    [(_, dataset)] = resolve(name, SHARED, None)
    rows = Task(spec.model_copy(update={"dataset": dataset})).rows()
    reward = build_reward("math", {})
    wrong = []
    for row in rows:
        solution = row.fields.get("solution")
        if name == "gsm8k":  # the solution's own final line, as a model would write it
            reference = row.fields["answer"].split("####")[-1].strip()
        elif isinstance(solution, str) and extract_boxed(solution):
            reference = extract_boxed(solution)
        else:  # no worked solution: the answer as the file writes it
            reference = row.ground_truth if isinstance(row.ground_truth, str) else row.ground_truth[0]
        if reward(f"\\boxed{{{reference}}}", row.ground_truth).parts["correct"] < 1:
            wrong.append((row.id, reference, row.ground_truth))
    print(f"{name}: {len(rows) - len(wrong)}/{len(rows)} agree; disagreements: {wrong}")
    assert (len(rows) - len(wrong)) / len(rows) >= REFERENCE[name], wrong


class AnswerTagEngine(TableEngine):
    """Answers in Search-R1's `<answer>` tags: "Paris" for row 0 (exact), "the city of Paris" for row 1 (F1 only)."""

    async def generate(self, prompt_ids, sampling, *, session=None) -> Completion:
        prompt_id = session.rsplit("/", 1)[0]
        text = {"0": "<answer> Paris </answer>", "1": "<answer> the city of Paris </answer>"}[prompt_id]
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [-0.5] * len(ids), "stop", None)


def test_qa_benchmarks_report_exact_match_and_f1(tmp_path, tok):
    _write(tmp_path / "data" / "qa" / "bamboogle.json",
           [{"question": "Capital of France?", "answer": ["Paris"]}, {"question": "And again?", "answer": ["Paris"]}])
    rows = json.loads((tmp_path / "data" / "qa" / "bamboogle.json").read_text())
    assert len(rows) == 2
    spec = load_task(REPO / "tasks" / "search_r1.yaml",
                     ["prompt.messages=null", "prompt.template=Question: {question}\n"]).spec
    engine = AnswerTagEngine(tok)
    results = asyncio.run(run_eval(spec=spec, benchmarks="bamboogle", engine=engine, tokenizer=tok,
                                   out=tmp_path / "out", n=1, temperature=0.0, data_dir=str(tmp_path / "data"),
                                   no_tools=True, progress=False))["bamboogle"]
    # row 1: "city of paris" (articles dropped) against "paris": precision 1/3, recall 1
    assert results["pass@1"] == 0.5
    assert results["f1"] == pytest.approx((1.0 + 2 * (1 / 3) * 1 / (1 / 3 + 1)) / 2)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["torl_math", "search_r1"])
def test_the_eval_command_serves_the_tools_it_needs(tmp_path, tok, task):
    """`agentrl eval` end to end on a tiny random checkpoint: the sandbox, or a retriever over an index
    built here, started by the command itself."""
    import subprocess
    import sys

    from agentrl.engine.random_model import write_random_checkpoint
    from tests.test_retriever_support import build_index, write_jsonl

    model = write_random_checkpoint(tmp_path / "model", tok, shape="tiny", dtype="float32",
                                    max_position_embeddings=2048)
    args = ["--benchmarks", "gsm8k", "--data-dir", str(tmp_path / "data")]
    if task == "search_r1":
        _write(tmp_path / "data" / "qa" / "nq_test.json", [{"question": "capital of france", "answer": ["Paris"]}] * 2)
        corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"id": "0", "contents": '"Paris"\nParis is the capital.'}])
        build_index(corpus, tmp_path / "index", "bm25")
        args = ["--benchmarks", "nq", "--data-dir", str(tmp_path / "data"), "--index", str(tmp_path / "index")]
    else:
        _write(tmp_path / "data" / "math" / "gsm8k_test.jsonl", [{"question": "1 + 1?", "answer": "1 + 1\n#### 2"}] * 2)
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--model", str(model), "--task",
                          f"tasks/{task}.yaml", "--n", "2", "--temperature", "1.0", "--engine", "hf", "--out",
                          str(tmp_path / "out"), "--set", "budgets.max_response_tokens=16", *args],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    [(name, metrics)] = json.loads((tmp_path / "out" / "results.json").read_text())["results"].items()
    assert metrics["prompts"] == 2 and metrics["samples"] == 4 and ("f1" in metrics) == (task == "search_r1")
    service = "retriever" if task == "search_r1" else "sandbox"
    assert (tmp_path / "out" / "logs" / f"{service}.log").exists()
    assert f"| {name} | 2 |" in out.stdout
