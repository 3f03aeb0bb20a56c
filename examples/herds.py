"""Data for examples/herds.yaml, a task that needs both tools: what a fictional person's herd is worth.

    python examples/herds.py runs/examples/herds

Each question names a person and a price per goat; how many goats the person keeps is written only in
their passage of the corpus, so the model must search for it, and the product of two 3-digit and 2-digit
numbers is what a small model gets wrong in its head and right with the interpreter. Written from a seed,
as the quickstart's data is (the people and the held-out split are agentrl.quickstart.entities'), under
OUT: corpus.jsonl, train.jsonl, test.jsonl and index/ (the retriever's BM25 index of the corpus). OUT
appears only when all of it is there.
"""

from __future__ import annotations

import argparse
import random
import shutil
import uuid
from pathlib import Path

from agentrl.config import write_jsonl
from agentrl.quickstart import entities


def herds(count: int, seed: int) -> list[tuple[entities.Person, int]]:
    """`count` people, each with the size of their herd (120 to 980 goats)."""
    rng = random.Random(f"herds/{seed}")
    return [(person, rng.randint(120, 980)) for person in entities.people(count, seed)]


def corpus(herd: list[tuple[entities.Person, int]]) -> list[dict[str, str]]:
    return [{"id": p.name, "contents": f"{p.name}\n{p.name} was born in {p.town} and keeps a herd of {size} goats."}
            for p, size in herd]


def rows(herd: list[tuple[entities.Person, int]], split: str, seed: int) -> list[dict[str, object]]:
    """One question per person of `split`: the herd's worth at a price per goat drawn from the seed."""
    rng = random.Random(f"prices/{seed}/{split}")
    out: list[dict[str, object]] = []
    for person, size in herd:
        if entities.split_of(person) != split:
            continue
        price = rng.randint(11, 99)
        out.append({"id": f"{split}-{len(out)}", "answer": str(size * price),
                    "question": f"{person.name} sells every goat of their herd for {price} coins each. "
                                "How many coins is that?"})
    return out


def prepare(out: Path, people: int = 400, seed: int = 0) -> Path:
    """Everything examples/herds.yaml reads, under `out` (which must not exist)."""
    from retriever.build import BuildConfig, build

    if out.exists():
        raise FileExistsError(f"{out} exists; remove it to write the data afresh")
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    try:
        herd = herds(people, seed)
        write_jsonl(tmp / "corpus.jsonl", corpus(herd))
        write_jsonl(tmp / "train.jsonl", rows(herd, "train", seed))
        write_jsonl(tmp / "test.jsonl", rows(herd, "test", seed))
        build(BuildConfig(corpus=tmp / "corpus.jsonl", out=tmp / "index", index_type="bm25", progress=False))
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to create")
    parser.add_argument("--people", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        prepare(args.out, args.people, args.seed)
    except FileExistsError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"wrote {args.out}/: corpus.jsonl, train.jsonl, test.jsonl, index/")
