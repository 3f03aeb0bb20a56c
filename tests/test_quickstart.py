"""The quickstart's generators: seeded, held-out items disjoint from training ones, answers right, the
fictional facts the same in the corpus and the questions."""

from __future__ import annotations

import re

import pytest

from agentrl.quickstart import arithmetic, entities


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
        if "gives away" in p.problem or "break" in p.problem:
            expected = a * b - c[0]
        elif "loose eggs" in p.problem:
            expected = a * b + c[0]
        else:
            expected = a * b
        assert 100_000 <= expected <= 999_999
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


def test_people_are_seeded_and_held_out_people_never_asked_about_in_training():
    assert entities.people(500, seed=1) == entities.people(500, seed=1)
    assert entities.people(500, seed=1) != entities.people(500, seed=2)
    persons = entities.people(1600)
    assert len({p.name for p in persons}) == 1600
    train = entities.questions(persons, "train")
    test = entities.questions(persons, "test")
    assert len(test) > 300 and len(train) > 9 * len(test) // 2
    asked_in_training = {q.person.name for q in train}
    assert not asked_in_training & {q.person.name for q in test}
    assert not {q.question for q in train} & {q.question for q in test}


def test_questions_are_answered_by_their_persons_passage_alone():
    """Parse each question's name, find the passage titled with it and read the asked fact from its text."""
    persons = entities.people(800)
    passages = {}
    for row in entities.corpus(persons):
        title, text = row["contents"].split("\n")
        passages[title] = text
    assert len(passages) == 800
    pattern = re.compile(r"(?P<name>.+) was born in (?P<town>\w+), plays the (?P<instrument>\w+) and keeps a (?P<animal>\w+)\.")
    for q in entities.questions(persons, "test") + entities.questions(persons, "train")[:300]:
        name = re.fullmatch(r"(?:Where was|Which instrument does|Which animal does) (.+) (?:born|play|keep)\?",
                            q.question).group(1)
        facts = pattern.fullmatch(passages[name])
        assert facts["name"] == name and facts[q.relation] == q.answer
        relation = {"Where": "town", "Which instrument": "instrument", "Which animal": "animal"}
        assert relation[next(k for k in relation if q.question.startswith(k))] == q.relation


def test_search_traces_search_the_name_and_answer_from_the_first_passage():
    persons = entities.people(800)
    items = entities.questions(persons, "train")[:400]
    traces = entities.traces(items, persons, "Q: {question}\n", tool_share=0.5, seed=3)
    searched = [t for t in traces if len(t["segments"]) == 3]
    assert 150 < len(searched) < 250
    for t, q in zip(traces, items, strict=True):
        answer = re.fullmatch(r"<answer> (\w+) </answer>", t["segments"][-1]["text"]).group(1)
        if len(t["segments"]) == 3:
            assert t["segments"][0]["text"] == f"<search> {q.person.name} </search>"
            info = t["segments"][1]["text"]
            first = re.search(r"Doc 1\(Title: ([^)]+)\)", info).group(1)
            assert first == q.person.name and info.count("Doc ") == 3 and answer == q.answer
    guesses = [(t, q) for t, q in zip(traces, items, strict=True) if len(t["segments"]) == 1]
    right = sum(f"<answer> {q.answer} </answer>" == t["segments"][0]["text"] for t, q in guesses)
    assert right < 0.3 * len(guesses)


def test_search_topk_reaches_the_search_client_and_is_checked():
    from agentrl.config import ConfigError
    from agentrl.task import load_task
    from agentrl.tools import build_tools

    spec = load_task("tasks/quickstart_search.yaml").spec
    assert spec.tools.search_topk == 1
    assert build_tools({"search": "http://127.0.0.1:9"}, spec.tools.search_topk)["search"].topk == 1
    assert build_tools({"search": "http://127.0.0.1:9"})["search"].topk == 3
    with pytest.raises(ConfigError, match="search_topk"):
        load_task("tasks/quickstart_search.yaml", ["tools.search_topk=0"])


def test_prepare_writes_everything_once(tmp_path):
    from agentrl.quickstart.__main__ import prepare_to

    out = prepare_to(tmp_path / "qs", code_train=300, code_test=20, people=200, progress=False)
    for name in ("code/train.jsonl", "code/test.jsonl", "code/traces.jsonl", "search/corpus.jsonl",
                 "search/train.jsonl", "search/test.jsonl", "search/traces.jsonl", "search/index/manifest.json",
                 "tokenizer/tokenizer.json"):
        assert (out / name).is_file(), name
    assert len((out / "code/traces.jsonl").read_text().splitlines()) == 300
    # The quickstart specs' made_by (a fresh clone's validate passes on it) is the command that wrote these
    from agentrl.task import load_task

    for task in ("tasks/quickstart_code.yaml", "tasks/quickstart_search.yaml"):
        ds = load_task(task).spec.dataset
        assert ds.made_by.command == "python -m agentrl.quickstart prepare runs/quickstart", task
        for split in ("train", "test"):
            relative = ds.path.replace("/train.", f"/{split}.")
            assert ds.made_by.writes(relative) and (out / relative.removeprefix("runs/quickstart/")).is_file()
    assert len((out / "search/corpus.jsonl").read_text().splitlines()) == 200
    with pytest.raises(FileExistsError, match="exists"):
        prepare_to(out, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qs"]  # no temporary left behind
    again = prepare_to(tmp_path / "again", code_train=300, code_test=20, people=200, progress=False)
    for name in ("code/traces.jsonl", "search/traces.jsonl", "search/corpus.jsonl", "tokenizer/tokenizer.json"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name  # same seed, same files
