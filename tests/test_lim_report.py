"""LIMR's selection (`agentrl lim`) on hand-computed trajectories, on LIMR's published scores and on a real
run's prompt_stats; the run report (`agentrl report`) from a real tiny run."""

from __future__ import annotations

import html
import json
import struct
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.config import ConfigError
from agentrl.lim import epoch_accuracies, lim_scores, select
from agentrl.run_config import load_run_config
from agentrl.trainer import train
from tests.conftest import REPO, SHARED, shared_file

LIMR_SCORES = SHARED / "limr" / "lim_scores.json"


def _records(table: dict[str, list[float | None]]) -> list[dict]:
    return [{"prompt_id": p, "epoch": k, "correct": r} for p, seq in table.items() for k, r in enumerate(seq)
            if r is not None]


def test_lim_scores_equal_hand_computed_ones_with_backfill_and_drops():
    table = {
        "a": [0.0, 0.5, 1.0],
        "b": [1.0, 1.0, 1.0],
        "c": [None, 0.5, 0.5],   # epoch 0 back-filled from epoch 1
        "d": [0.0, 0.5, None],   # the last epoch missing: dropped
        "e": [None, None, 1.0],  # one forward pass fills only epoch 1: dropped
    }
    scores = lim_scores(epoch_accuracies(_records(table), "test"))
    # kept a, b, c; per-epoch means 1/2, 2/3, 5/6; the denominator 1/4 + 1/9 + 1/36 = 14/36
    expected = {"a": 1 - Fraction(11, 14), "b": Fraction(0), "c": 1 - Fraction(5, 14)}
    assert scores.keys() == expected.keys()
    for p, s in expected.items():
        assert scores[p] == pytest.approx(float(s), abs=1e-12)


def test_records_of_one_prompt_and_epoch_are_averaged_by_samples():
    records = [{"prompt_id": "a", "epoch": 0, "correct": 0.0, "n": 2}, {"prompt_id": "a", "epoch": 0, "correct": 1.0,
                                                                         "n": 6}]
    assert epoch_accuracies(records, "t") == {"a": {0: 0.75}}
    with pytest.raises(ConfigError, match=r"correct=-1.0 is outside \[0, 1\]"):
        epoch_accuracies([{"prompt_id": "a", "epoch": 0, "correct": -1.0}], "t")
    with pytest.raises(ConfigError, match="record 1"):
        epoch_accuracies([{"prompt_id": "a", "correct": 1.0}], "t")
    with pytest.raises(ConfigError, match="undefined"):
        lim_scores({"a": {0: 1.0, 1: 1.0}})


@pytest.mark.skipif(not LIMR_SCORES.exists(), reason=f"LIMR's published scores are not at {LIMR_SCORES}")
def test_limrs_published_scores_at_0_6_select_1389_of_7935():
    published = json.loads(LIMR_SCORES.read_text())
    scores = {str(i): row["score"] for i, row in enumerate(published)}
    chosen, rand = select(scores, 0.6, seed=0)
    assert (len(chosen), len(scores)) == (1389, 7935)
    assert len(rand) == 1389 and len(set(rand)) == 1389 and rand == select(scores, 0.6, seed=0)[1]
    assert rand != select(scores, 0.6, seed=1)[1]


def test_lim_over_a_rewards_log_lists_the_selected_prompts(tmp_path):
    log = tmp_path / "rewards.jsonl"
    table = {"a": [0.0, 0.5, 1.0], "b": [1.0, 1.0, 1.0], "c": [None, 0.5, 0.5], "d": [0.0, 0.5, None]}
    log.write_text("".join(json.dumps(r) + "\n" for r in _records(table)))
    result = CliRunner().invoke(app, ["lim", "--rewards-log", str(log), "--threshold", "0.5",
                                      "--out", str(tmp_path / "sel.jsonl")])
    assert result.exit_code == 0, result.output
    assert "scored 3 of 4 prompts (1 dropped" in result.output and "selected 1 with score >= 0.5" in result.output
    selected = [json.loads(line) for line in (tmp_path / "sel.jsonl").read_text().splitlines()]
    assert [s["prompt_id"] for s in selected] == ["c"] and selected[0]["score"] == pytest.approx(9 / 14)
    assert len((tmp_path / "sel.rand.jsonl").read_text().splitlines()) == 1
    bad = CliRunner().invoke(app, ["lim", "--out", str(tmp_path / "x.jsonl")])
    assert bad.exit_code == 2 and "give a RUN_DIR or --rewards-log" in bad.output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A real run of three epochs over 8 prompts (the debug config's tiny model and the sandbox)."""
    tmp = tmp_path_factory.mktemp("lim")
    rows = [json.loads(line) for line in (REPO / "tasks/data/arithmetic.jsonl").read_text().splitlines()[:8]]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the config's relative paths (tasks/, configs/) are taken from here
        config = load_run_config(REPO / "configs/debug_cpu.yaml", [
            f"task.dataset.path={tmp / 'data.jsonl'}", f"trainer.run_dir={tmp / 'run'}", "trainer.steps=null",
            "trainer.epochs=3", "trainer.eval_every=0", "trainer.eval_holdout=0", "trainer.save_every=0",
            "logging.progress=false", "trainer.samples_per_step=2"])
        return train(config).root


def test_the_trainers_prompt_stats_give_each_prompts_accuracy_per_epoch(run_dir):
    stats = [json.loads(line) for line in (run_dir / "prompt_stats.jsonl").read_text().splitlines()]
    assert sorted({(s["epoch"], s["prompt_id"]) for s in stats}) == [(k, f"arith-{i}") for k in range(3) for i in range(8)]
    assert all(0.0 <= s["correct"] <= 1.0 and s["n"] == 4 for s in stats)


def test_lim_over_a_run_writes_dataset_rows_a_task_loads(run_dir, tmp_path):
    from agentrl.lim import run_rows
    from agentrl.task import load_task

    stats = [json.loads(line) for line in (run_dir / "prompt_stats.jsonl").read_text().splitlines()]
    accuracies = epoch_accuracies(stats, "stats")
    scores = lim_scores(accuracies)
    out = tmp_path / "sel.jsonl"
    result = CliRunner().invoke(app, ["lim", str(run_dir), "--threshold", "-100", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "scored 8 of 8 prompts" in result.output
    selected = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in selected] == [r.id for r in run_rows(run_dir)] and len(scores) == 8
    task = load_task(REPO / "tasks/torl_math.yaml", [f"dataset.path={out}", "dataset.fields.id=id",
                                                     "dataset.fields.question=problem"])
    assert [r.id for r in task.rows()] == [r["id"] for r in selected]
    assert len((tmp_path / "sel.rand.jsonl").read_text().splitlines()) == 8


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_the_report_renders_a_tiny_runs_curves_and_samples(run_dir, tmp_path):
    result = CliRunner().invoke(app, ["report", str(run_dir), str(run_dir), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    pngs = {p.stem: p for p in (tmp_path / "rep").glob("*.png")}
    assert {"reward", "length", "tools", "tool_errors", "tool_latency", "loss", "kl", "entropy", "clip",
            "grad_norm"} <= set(pngs)
    assert any(name.startswith("timing_") for name in pngs)
    for p in pngs.values():
        width, height = _png_size(p)
        assert width > 300 and height > 200 and p.stat().st_size > 5000
    page = (tmp_path / "rep/report.html").read_text()
    assert page.count("data:image/png;base64,") == len(pngs)
    # the trajectory viewer, its page and data inlined (tests/test_view.py opens it in a browser)
    assert page.count('<iframe class="viewer"') == 1 and "window.AGENTRL_EMBED" in html.unescape(page)
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "no metrics.jsonl" in missing.output


def test_the_limr_recipes_task_reads_limrs_8523_problems(qwen_tokenizer, monkeypatch):
    """tasks/limr_math.yaml over LIMR's own file: every problem a prompt in LIMR's chat form (its system
    message, the problem as the user's), the answer as the ground truth."""
    from agentrl.task import Task

    monkeypatch.chdir(REPO)
    path = shared_file("limr/math8k.json")
    spec = load_run_config(REPO / "configs/limr_qwen2.5-math-7b.yaml", [f"task.dataset.path={path}"]).task
    prompts = list(Task(spec, source="task").prompts(qwen_tokenizer))
    rows = json.loads(path.read_text())
    graded = [r for r in rows if r["answer"]]
    assert len(rows) == 8523 and len(graded) == 8521  # two have no answer to grade against: filtered out
    assert len(prompts) == len(graded) - 8  # 8 run past the 1,024-token prompt budget and are dropped
    first = prompts[0]
    assert first.id == rows[0]["id"] and first.ground_truth == rows[0]["answer"]
    assert first.text.startswith("<|im_start|>system\nPlease reason step by step, and put your final answer within "
                                 "\\boxed{}.<|im_end|>\n<|im_start|>user\n" + rows[0]["prompt"])
    assert first.text.endswith("<|im_start|>assistant\n")
