"""task.py and the shipped task specs: field mapping, prompts character for character, budgets, errors."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from agentrl.config import ConfigError
from agentrl.task import load_task
from tests.conftest import REPO, shared_file

TORL = REPO / "tasks" / "torl_math.yaml"
SEARCH_R1 = REPO / "tasks" / "search_r1.yaml"

# ToRL's tir_base_0309 (GAIR-NLP/ToRL, verl/utils/dataset/rl_dataset.py) with [PROMPT] replaced.
TORL_HEAD = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
    "User: Please integrate natural language reasoning with programs to solve the problem above, "
    "and put your final answer within \\boxed{}.\n"
)
# Search-R1's `base` template (scripts/data_process/nq_search.py, make_prefix).
SEARCH_R1_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: "
)

MATH_ROWS = [
    {"problem": "What is $1+1$?", "answer": "2", "solution": "Clearly $\\boxed{2}$.", "unique_id": "a", "level": 1},
    {"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "unique_id": "b", "level": 2},
    {"problem": "Three?", "answer": "", "solution": "$\\boxed{3}$ and then \\boxed{\\{4\\}}", "unique_id": "c", "level": 3},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def math_file(tmp_path):
    return write_jsonl(tmp_path / "math.jsonl", MATH_ROWS)


def test_torl_prompt_is_tir_base_0309_character_for_character(math_file):
    task = load_task(TORL, [f"dataset.path={math_file}", "dataset.shuffle=false"])
    rows = task.rows()
    assert [r.id for r in rows] == ["a", "b", "c"]
    assert task.render_text(rows[0]) == TORL_HEAD + "What is $1+1$?\nAssistant:\n"


def test_math_ground_truth_from_answer_or_last_boxed_of_solution(math_file):
    rows = load_task(TORL, [f"dataset.path={math_file}", "dataset.shuffle=false"]).rows()
    assert [r.ground_truth for r in rows] == ["2", "\\frac{1}{2}", "\\{4\\}"]


def test_search_r1_prompt_character_for_character(tmp_path, tiny_tokenizer):
    data = tmp_path / "nq.json"
    data.write_text(json.dumps([{"question": " who wrote hamlet ", "answer": ["Shakespeare", "W. Shakespeare"]}]))
    task = load_task(SEARCH_R1, [f"dataset.path={data}", "dataset.fields.answer=answer"])
    (row,) = task.rows()
    assert row.question == "who wrote hamlet?"  # stripped, and Search-R1's "?" appended
    assert row.ground_truth == ["Shakespeare", "W. Shakespeare"]
    text = task.render_text(row, tiny_tokenizer)
    user = SEARCH_R1_PREFIX + "who wrote hamlet?\n"
    assert text == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    prompt = task.render(row, tiny_tokenizer)
    assert tiny_tokenizer.decode(list(prompt.token_ids)) == text


def test_filter_shuffle_limit_are_seeded(tmp_path):
    rows = [{"problem": f"q{i}", "answer": str(i), "level": i % 3} for i in range(50)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    base = [f"dataset.path={path}", "dataset.shuffle=true", "dataset.limit=5"]
    a = [r.id for r in load_task(TORL, base + ["dataset.seed=1"]).rows()]
    b = [r.id for r in load_task(TORL, base + ["dataset.seed=1"]).rows()]
    c = [r.id for r in load_task(TORL, base + ["dataset.seed=2"]).rows()]
    assert a == b and a != c and len(a) == 5
    picked = load_task(TORL, [f"dataset.path={path}", "dataset.shuffle=false",
                              "dataset.filter=[{field: level, op: eq, value: 0}, {field: answer, op: ne, value: '0'}]"]).rows()
    assert [r.ground_truth for r in picked] == [str(i) for i in range(3, 50, 3)]
    within = load_task(TORL, [f"dataset.path={path}", "dataset.shuffle=false",
                              "dataset.filter=[{field: level, op: in, value: [1, 2]}]", "dataset.limit=4"]).rows()
    assert [r.question for r in within] == ["q1", "q2", "q4", "q5"]


def test_filters_and_reward_params_that_cannot_be_right_are_named(tmp_path):
    rows = [{"problem": f"q{i}", "answer": str(i), "level": i % 3} for i in range(6)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    cases = [
        ("dataset.filter=[{field: levle, value: 1}]", r"dataset\.filter\[0\]\.field: no row of .* has a field 'levle'; they have: answer, level, problem"),
        ("dataset.filter=[{field: level, value: 7}]", "dataset.filter: keeps none of the 6 rows"),
        ("dataset.filter=[{field: level, op: in, value: 1}]", "op 'in' needs a list as value, got 1"),
        ("reward.params={corect: 2.0}", "unknown key 'params.corect'; math takes: correct, incorrect"),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_task(TORL, [f"dataset.path={path}", override]).rows()
    # contains on a number is "does not contain", not a crash
    kept = load_task(TORL, [f"dataset.path={path}", "dataset.filter=[{field: level, op: contains, value: 1}, "
                                                     "{field: problem, op: contains, value: q}]"])
    with pytest.raises(ConfigError, match="keeps none"):
        kept.rows()


def test_answer_regex_reads_gsm8k_answers(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Eggs?", "answer": "16 - 3 = 13\n#### 18"}])
    task = load_task(TORL, [f"dataset.path={path}", "dataset.fields.question=question",
                            "dataset.answer_regex=####\\s*(.+)"])
    assert task.rows()[0].ground_truth == "18"


def test_parquet_and_json_dict_wrapped(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(MATH_ROWS[:1]), tmp_path / "m.parquet")
    assert load_task(TORL, [f"dataset.path={tmp_path / 'm.parquet'}"]).rows()[0].ground_truth == "2"
    (tmp_path / "w.json").write_text(json.dumps({"data": MATH_ROWS[:2]}))
    assert len(load_task(TORL, [f"dataset.path={tmp_path / 'w.json'}"]).rows()) == 2


def test_max_prompt_tokens_drops_long_prompts(tmp_path, tiny_tokenizer):
    rows = [{"problem": "short", "answer": "1"}, {"problem": "long " * 200, "answer": "2"}]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    task = load_task(TORL, [f"dataset.path={path}", "dataset.shuffle=false"])
    prompts = list(task.prompts(tiny_tokenizer))
    assert [p.ground_truth for p in prompts] == ["1"] and task.dropped_too_long == 1
    assert list(prompts[0].token_ids) == tiny_tokenizer(prompts[0].text)["input_ids"]


def test_hermes_renders_tool_schemas_with_the_chat_template(tmp_path, qwen_tokenizer):
    spec = tmp_path / "hermes.yaml"
    data = write_jsonl(tmp_path / "m.jsonl", MATH_ROWS[:1])
    spec.write_text(
        f"name: hermes_math\ndataset: {{path: {data}}}\n"
        "prompt: {messages: [{role: user, content: '{question}'}]}\n"
        "tools: {format: hermes, names: [python]}\nreward: {name: math}\n"
        "budgets: {max_turns: 3, max_tool_calls: 2}\n"
    )
    task = load_task(spec)
    text = task.render_text(task.rows()[0], qwen_tokenizer)
    assert "<tools>" in text and '"name": "python"' in text
    assert text.endswith("<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("budgets.max_turnz=3", "unknown key 'budgets.max_turnz'"),
        ("budgets.max_turns=three", "budgets.max_turns: got 'three'"),
        ("budgets.max_turns=1", "must exceed max_tool_calls"),
        ("tools.format=search_r1", "drives exactly the tool [search]"),
        ("tools.format=smoke", "tools.format: got 'smoke'"),
        ("tools.format=hermes", "the hermes format does not apply it"),  # observation_max_chars is ToRL's
        ("reward.name=nope", "unknown reward 'nope'"),
        ("reward.params.corect=1", "corect"),
        ("prompt.template=no placeholder", "{question}"),
        ("dataset.limit=0", "dataset.limit"),
        ("dataset.answer_regex=(", "not a valid pattern"),
        ("tools.names=[]", "format 'tags' drives the tools python and search"),
        ("budgets.max_calls_per_tool.serch=1", "names 'serch', which is not a tool of this task"),
        ("budgets.max_calls_per_tool.python=0", "budgets.max_calls_per_tool.python: got 0"),
    ],
)
def test_bad_specs_get_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as e:
        load_task(TORL, ["tools.format=tags" if "tools.names" in override or "per_tool" in override else "name=x",
                         override])
    assert needle in str(e.value)
    assert str(TORL) in str(e.value) or override.startswith("budgets.max_turnz")


def test_missing_dataset_names_the_path():
    task = load_task(TORL, ["dataset.path=no/such/file.jsonl"])
    with pytest.raises(ConfigError, match="no such file 'no/such/file.jsonl'"):
        task.rows()


def test_bad_rows_name_the_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{not json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        load_task(TORL, [f"dataset.path={bad}"]).rows()
    noq = write_jsonl(tmp_path / "noq.jsonl", [{"question": "x", "answer": "1"}])
    with pytest.raises(ConfigError, match="has no field 'problem'; it has: answer, question"):
        load_task(TORL, [f"dataset.path={noq}"]).rows()
    noa = write_jsonl(tmp_path / "noa.jsonl", [{"problem": "x", "solution": "no box"}])
    with pytest.raises(ConfigError, match="has no answer"):
        load_task(TORL, [f"dataset.path={noa}"]).rows()


def test_unreadable_datasets_and_answers_are_named(tmp_path, tiny_tokenizer):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"problem": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_task(TORL, [f"dataset.path={latin}"]).rows()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match="is not a readable parquet file"):
        load_task(TORL, [f"dataset.path={broken}"]).rows()
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"problem": "x", "answer": {"value": "5"}}])
    with pytest.raises(ConfigError, match="has an answer of type dict"):
        load_task(TORL, [f"dataset.path={nested}"]).rows()
    with pytest.raises(ConfigError, match="reward: params.correct: got 'abc'"):
        load_task(TORL, ["reward.params.correct=abc"])
    plain = copy.deepcopy(tiny_tokenizer)  # the fixture is shared by the session
    plain.chat_template = None
    search = write_jsonl(tmp_path / "nq.jsonl", [{"question": "who?", "golden_answers": ["me"], "id": "1"}])
    with pytest.raises(ConfigError, match="need a tokenizer with a chat template"):
        next(iter(load_task(SEARCH_R1, [f"dataset.path={search}"]).prompts(plain)))


def test_cli_validate_and_show_on_math500():
    """The issue's acceptance check: ToRL's exact prompt for the first two MATH500 problems."""
    math500 = shared_file("math/math500.jsonl")
    qwen = shared_file("tokenizers/qwen2.5-0.5b-instruct")
    agentrl = [sys.executable, "-m", "agentrl.cli"]
    ok = subprocess.run(agentrl + ["tasks", "validate", str(TORL), str(SEARCH_R1)], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("ok ") == 2
    shown = subprocess.run(
        agentrl + ["tasks", "show", str(TORL), "-n", "2", "--set", f"dataset.path={math500}", "--tokenizer", str(qwen)],
        capture_output=True, text=True, cwd=REPO,
    )
    assert shown.returncode == 0, shown.stderr
    first_two = [json.loads(line) for line in math500.read_text().splitlines()[:2]]
    for row in first_two:
        assert TORL_HEAD + row["problem"] + "\nAssistant:\n" in shown.stdout
    assert shown.stdout.count("──── prompt") == 2


def test_cli_validate_reports_bad_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(TORL.read_text().replace("max_turns: 2", "max_turns: 2\n  max_turnz: 3"))
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "validate", str(bad)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 1
    assert "unknown key 'budgets.max_turnz'" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _validate_in(cwd, *args):
    """`agentrl tasks validate` run in `cwd`, with this checkout's code (whatever the venv's install points at)."""
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "validate", *args],
                          capture_output=True, text=True, cwd=cwd, env=env)


@pytest.fixture
def fresh_clone(tmp_path):
    """The shipped task specs in a directory without runs/: a fresh clone before `make demo`."""
    (tmp_path / "tasks").mkdir()
    for spec in (REPO / "tasks").glob("*.yaml"):
        (tmp_path / "tasks" / spec.name).write_text(spec.read_text())
    return tmp_path


def test_cli_validate_on_a_fresh_clone_says_where_the_data_comes_from(fresh_clone):
    """The README's first command before the quickstart wrote its data: every shipped spec validates, and
    those whose file is not there yet name it and the command that writes it."""
    specs = sorted(f"tasks/{p.name}" for p in (fresh_clone / "tasks").glob("*.yaml"))
    assert "tasks/quickstart_code.yaml" in specs and "tasks/quickstart_search.yaml" in specs
    out = _validate_in(fresh_clone, *specs)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout.count("ok ") == len(specs)
    for data in ("runs/quickstart/code/train.jsonl", "runs/quickstart/search/train.jsonl"):
        (line,) = [ln for ln in out.stdout.splitlines() if f"dataset {data}: not there yet" in ln]
        assert line.endswith("`python -m agentrl.quickstart prepare runs/quickstart` writes it")
    assert not (fresh_clone / "runs").exists()  # validating writes nothing

    # the held-out split (make demo's eval) is the same command's; --load asks for the rows themselves,
    # which are not there: a failure, naming the command all the same
    loaded = _validate_in(fresh_clone, "tasks/quickstart_code.yaml", "--load",
                          "--set", "dataset.path=runs/quickstart/code/test.jsonl")
    assert loaded.returncode == 1 and "Traceback" not in loaded.stderr
    assert "no such file 'runs/quickstart/code/test.jsonl' yet" in loaded.stderr
    assert "`python -m agentrl.quickstart prepare runs/quickstart` writes it" in loaded.stderr


def test_cli_validate_on_a_fresh_clone_still_fails_broken_specs_and_missing_data(fresh_clone):
    spec = (fresh_clone / "tasks" / "quickstart_code.yaml").read_text()
    (fresh_clone / "tasks" / "bad_budgets.yaml").write_text(spec.replace("max_turns: 2", "max_turns: 1"))
    (fresh_clone / "tasks" / "bad_yaml.yaml").write_text(spec.replace("name: quickstart_code", "name: [quickstart"))
    cases = [
        (["tasks/bad_budgets.yaml"], "tasks/bad_budgets.yaml: budgets.max_turns (1) must exceed max_tool_calls (1)"),
        (["tasks/bad_yaml.yaml"], "tasks/bad_yaml.yaml: invalid YAML (line"),
        (["tasks/quickstart_code.yaml", "--set", "budgets.max_turnz=3"], "unknown key 'budgets.max_turnz'"),
        (["tasks/quickstart_code.yaml", "--set", "dataset.made_by.comand=x"], "unknown key 'dataset.made_by.comand'"),
        # a file made_by does not write is the user's own: missing, it is an error
        (["tasks/quickstart_code.yaml", "--set", "dataset.path=data/mine.jsonl"], "no such file 'data/mine.jsonl' (relative"),
        (["tasks/quickstart_code.yaml", "--set", "dataset.path=runs/quickstart_2/code/train.jsonl"], "no such file"),
    ]
    for args, message in cases:
        out = _validate_in(fresh_clone, *args)
        assert out.returncode == 1, (args, out.stdout)
        assert message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "writes it" not in out.stderr


def test_made_by_speaks_for_its_own_files_only(tmp_path, monkeypatch):
    """The hint where the rows are read (train, sft, eval, tasks show / check) too, and never for a path
    that --set or a run config changed to one made_by does not write."""
    from agentrl.task import DataNotPrepared

    monkeypatch.chdir(tmp_path)
    made = ["dataset.made_by={command: make data, files: data/made/}"]
    with pytest.raises(DataNotPrepared, match=r"no such file 'data/made/a\.jsonl' yet .*: `make data` writes it"):
        load_task(TORL, ["dataset.path=data/made/a.jsonl", *made]).rows()
    with pytest.raises(DataNotPrepared, match="`make data` writes it"):
        load_task(TORL, [f"dataset.path={tmp_path}/data/made/sub/b.jsonl", *made]).check_dataset()
    for path in ("data/mad/a.jsonl", "data/made.jsonl", "elsewhere/data/made/a.jsonl"):
        with pytest.raises(ConfigError, match="no such file") as e:
            load_task(TORL, [f"dataset.path={path}", *made]).check_dataset()
        assert not isinstance(e.value, DataNotPrepared) and "make data" not in str(e.value), path
    one = ["dataset.made_by={command: make one, files: data/one.jsonl}"]
    with pytest.raises(DataNotPrepared):
        load_task(TORL, ["dataset.path=./data/one.jsonl", *one]).check_dataset()
    with pytest.raises(ConfigError, match="no such file 'data/one.jsonl.gz.jsonl'") as e:
        load_task(TORL, ["dataset.path=data/one.jsonl.gz.jsonl", *one]).check_dataset()
    assert not isinstance(e.value, DataNotPrepared)
