"""`agentrl sft`: trajectories (trainer dumps or chat messages) -> masked supervised steps on the RL learner."""

from __future__ import annotations

import json

import pytest

from agentrl.config import ConfigError, load_model
from agentrl.sft import SFTConfig, read_trajectories, sft
from agentrl.task import load_tokenizer
from tests.conftest import REPO

CODE = "```python\nprint(2 + 3)\n```\n```output"
OUTPUT = "\n5\n```\n"
ANSWER = "The answer is \\boxed{5}.<|im_end|>"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("configs/tiny_tokenizer")


def dump_row(i: int) -> dict:
    return {"id": f"q{i}", "prompt": f"What is 2 + 3? ({i})\nAssistant:\n",
            "segments": [{"source": "model", "text": CODE}, {"source": "tool", "text": OUTPUT},
                         {"source": "model", "text": ANSWER}]}


def test_a_trainer_dump_becomes_masked_trajectories(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(dump_row(0)) + "\n")
    [t] = read_trajectories(path, tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert list(t.prompt.token_ids) == tok("What is 2 + 3? (0)\nAssistant:\n")["input_ids"]
    assert t.loss_mask == [1] * len(enc(CODE)) + [0] * len(enc(OUTPUT)) + [1] * len(enc(ANSWER))


def test_text_with_unicode_line_separators_stays_on_its_line(tmp_path, tok):
    """A model's text may hold U+2028, U+0085 or U+001E, which JSON (ensure_ascii off, as the trainer writes
    its samples) leaves raw: a line of the file ends at "\n" only, so each row is read whole, by sft as by
    the run dir's readers (config.read_jsonl)."""
    from agentrl.config import read_jsonl, write_jsonl

    row = dump_row(0)
    row["segments"][0]["text"] = CODE + "\u2028 x\x85 y\u2029"
    path = write_jsonl(tmp_path / "d.jsonl", [row, dump_row(1)])
    assert "\u2028" in path.read_text() and len(path.read_text().splitlines()) > 2  # raw in the file
    assert read_jsonl(path) == [row, dump_row(1)]
    [first, second] = read_trajectories(path, tok)
    assert tok.decode(first.segments[0].token_ids) == row["segments"][0]["text"] and second.prompt.id == "q1"


def test_chat_messages_split_at_message_boundaries(tmp_path, tok):
    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": CODE},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "\\boxed{5}"}]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    [t] = read_trajectories(path, tok)
    assert tok.decode(t.prompt.token_ids) == "<|im_start|>user\n2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    pieces = [(s.source, tok.decode(s.token_ids)) for s in t.segments]
    assert pieces == [("model", CODE + "<|im_end|>\n"),
                      ("tool", "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"),
                      ("model", "\\boxed{5}<|im_end|>\n")]


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "x"}', "line 1: expected 'prompt' and 'segments'"),
    ('{"prompt": "x", "segments": [{"source": "user", "text": "y"}]}', "line 1: segment source 'user'"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "line 1: the messages hold no assistant message"),
    ("not json", "line 1:"),
])
def test_malformed_lines_are_errors_naming_them(tmp_path, tok, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_trajectories(path, tok)


def test_sft_lowers_the_nll_of_what_the_model_wrote_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(dump_row(i)) + "\n" for i in range(8)))
    config = load_model(SFTConfig, REPO / "configs" / "sft_debug_cpu.yaml",
                        [f"data={data}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.epochs=15",
                         "learner.optim.lr=0.01", "logging.progress=false"])
    run = sft(config).root
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 15 * 2  # 8 trajectories in batches of 4
    assert metrics[-1]["sft/nll"] < 0.2 * metrics[0]["sft/nll"], [m["sft/nll"] for m in metrics]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_30"
    assert AutoModelForCausalLM.from_pretrained(run / "export") is not None
