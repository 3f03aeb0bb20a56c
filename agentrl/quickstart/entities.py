"""Seeded fictional people, a corpus of one passage each, and questions about them (the search quickstart),
with imperfect synthetic traces to warm-start a model with SFT.

Names and places are made of syllables no real text uses, so an answer cannot be known without reading the
passage: questions ask where a person was born, which instrument they play or which animal they keep,
and the person's passage in the corpus says it. Which split a person belongs to is decided by a hash of
the name, so held-out questions are about people no training question mentions. `traces` writes SFT data
in the trainer's dump format for the Search-R1 format: a share search for the name, read the top passages
(as the retriever ranks them: the person's own first, then people sharing a name) and answer from the
first; the rest answer at once with a guess, usually wrong.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from agentrl.quickstart import trace
from agentrl.tools.search import format_passages

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gl", "kr", "st", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "m"]
INSTRUMENTS = ["lute", "harp", "oboe", "viola", "flute", "drum", "cello", "horn", "banjo", "zither", "lyre",
               "fiddle"]
ANIMALS = ["heron", "weasel", "badger", "falcon", "lynx", "raven", "tortoise", "ferret", "stag", "crow", "hare",
           "goat"]
QUESTIONS = {
    "town": "Where was {name} born?",
    "instrument": "Which instrument does {name} play?",
    "animal": "Which animal does {name} keep?",
}


@dataclass(frozen=True)
class Person:
    name: str
    town: str
    instrument: str
    animal: str

    @property
    def passage(self) -> dict[str, str]:
        """The person's corpus row: `contents` is the title line, then the facts."""
        text = f"{self.name} was born in {self.town}, plays the {self.instrument} and keeps a {self.animal}."
        return {"id": self.name, "contents": f"{self.name}\n{text}"}


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answer: str
    person: Person
    relation: str


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


def people(count: int, seed: int = 0, towns: int = 24, given: int = 40, family: int = 40) -> list[Person]:
    """`count` distinct people (at most `given` x `family`), the same for the same seed: given and family
    names are drawn from pools, so people share names the way the retriever's distractors do; towns from
    a pool of `towns`."""
    if count > given * family:
        raise ValueError(f"count {count}: at most given x family = {given * family} distinct names")
    rng = random.Random(seed)
    pools = _distinct(rng, given + family + towns)
    given_names, family_names, town_names = pools[:given], pools[given:given + family], pools[given + family:]
    out: dict[str, Person] = {}
    while len(out) < count:
        name = f"{rng.choice(given_names)} {rng.choice(family_names)}"
        if name not in out:
            out[name] = Person(name, rng.choice(town_names), rng.choice(INSTRUMENTS), rng.choice(ANIMALS))
    return list(out.values())


def _distinct(rng: random.Random, count: int) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < count:
        words.setdefault(_word(rng, 2), None)
    return list(words)


def split_of(person: Person) -> str:
    digest = hashlib.sha256(person.name.encode()).digest()
    return "test" if digest[0] < 26 else "train"  # about 10% of the people held out


def corpus(persons: list[Person]) -> list[dict[str, str]]:
    """The corpus rows, one passage per person (`{"id", "contents": "Title\\ntext"}`)."""
    return [p.passage for p in persons]


def questions(persons: list[Person], split: str) -> list[Question]:
    """Every question (one per relation) about each person of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: expected 'train' or 'test'")
    out = []
    for p in persons:
        if split_of(p) != split:
            continue
        for relation, question in QUESTIONS.items():
            out.append(Question(f"{split}-{len(out)}", question.format(name=p.name), getattr(p, relation), p, relation))
    return out


def rows(items: list[Question]) -> list[dict[str, str]]:
    """The questions as dataset rows: id, question, answer (what a task spec's dataset reads)."""
    return [{"id": q.id, "question": q.question, "answer": q.answer} for q in items]


def traces(items: list[Question], persons: list[Person], prompt: str, tool_share: float = 0.5, topk: int = 3,
           seed: int = 0) -> list[dict]:
    """SFT traces in the trainer's dump format for the Search-R1 format: `prompt` is the task's template
    with `{question}`; a share `tool_share` search for the person's name, get `topk` passages (theirs,
    then people sharing a given or family name) and answer from theirs; the others answer with a guess
    from the relation's values (right about one time in a dozen)."""
    rng = random.Random(seed)
    by_part: dict[str, list[Person]] = {}
    for p in persons:
        for part in p.name.split():
            by_part.setdefault(part, []).append(p)
    values = {r: sorted({getattr(p, r) for p in persons}) for r in QUESTIONS}
    out = []
    for q in items:
        text = prompt.replace("{question}", q.question)
        if rng.random() < tool_share:
            near = [p for part in q.person.name.split() for p in by_part[part] if p != q.person]
            shown = [q.person, *rng.sample(near, min(topk - 1, len(near)))]
            info = format_passages([{"contents": p.passage["contents"]} for p in shown])
            out.append(trace(q.id, text, f"<search> {q.person.name} </search>",
                             f"\n\n<information>{info.strip()}</information>\n\n", f"<answer> {q.answer} </answer>"))
        else:
            out.append(trace(q.id, text, f"<answer> {rng.choice(values[q.relation])} </answer>"))
    return out
