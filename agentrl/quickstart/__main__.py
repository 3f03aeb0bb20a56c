"""The quickstart's two commands around `agentrl sft`, `agentrl train` and `agentrl eval` (see the Makefile's
`demo` target, which runs the whole thing):

    python -m agentrl.quickstart prepare runs/quickstart   # data, SFT traces, tokenizer, corpus, BM25 index
    python -m agentrl.quickstart table runs/quickstart     # the before/after table from the evals' results

`prepare` writes, all from seeds (nothing is downloaded):

    code/{train,test}.jsonl      word problems (arithmetic.py), the held-out ones disjoint from training
    code/traces.jsonl            SFT traces with the task's prompt, half of them calling the tool
    search/corpus.jsonl          one passage per fictional person (entities.py)
    search/{train,test}.jsonl    questions about them, the held-out ones about held-out people
    search/traces.jsonl          SFT traces, half of them searching
    search/index/                the retriever's BM25 index of the corpus
    tokenizer/                   BPE learned from all of the above, digits split

The prompts come from the task specs (tasks/quickstart_code.yaml, tasks/quickstart_search.yaml), so the
traces and the rollouts see the same text. Each file is written whole, and `out` appears only when all
of it is there (built in a temporary sibling, then renamed).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentrl.config import write_jsonl
from agentrl.quickstart import arithmetic, entities, tokenizer

if TYPE_CHECKING:
    from agentrl.task_spec import TaskSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n\n")[0])

CODE_TASK = "tasks/quickstart_code.yaml"
SEARCH_TASK = "tasks/quickstart_search.yaml"


def _spec(task: str) -> TaskSpec:
    from agentrl.task import load_task

    spec = load_task(task).spec
    if spec.prompt.template is None:
        raise ValueError(f"{task}: the quickstart needs prompt.template (a plain prompt)")
    return spec


def prepare_to(out: Path, *, seed: int = 0, code_train: int = 16000, code_test: int = 200, people: int = 1600,
               code_task: str = CODE_TASK, search_task: str = SEARCH_TASK, search: bool = True,
               progress: bool = True) -> Path:
    """Everything the quickstart reads, under `out` (see the module docstring); `out` must not exist.
    `search=False`: the code task's part only (no corpus, no index, a tokenizer of the code texts)."""
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it to prepare the quickstart afresh")
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}")
    try:
        train = arithmetic.problems("train", code_train, seed)
        write_jsonl(tmp / "code/train.jsonl", arithmetic.rows("train", code_train, seed))
        write_jsonl(tmp / "code/test.jsonl", arithmetic.rows("test", code_test, seed))
        code_traces = arithmetic.traces(train, _spec(code_task).prompt.template, "<|im_end|>", seed=seed)
        write_jsonl(tmp / "code/traces.jsonl", code_traces)

        texts = [t["prompt"] + "".join(s["text"] for s in t["segments"]) for t in code_traces]
        if search:
            texts += _prepare_search(tmp / "search", seed, people, search_task, progress)
        tokenizer.train(texts, tmp / "tokenizer", split_digits=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _prepare_search(out: Path, seed: int, people: int, search_task: str, progress: bool) -> list[str]:
    """The search task's corpus, questions, traces and BM25 index under `out`; returns their texts."""
    from retriever.build import BuildConfig, build

    persons = entities.people(people, seed)
    rows = entities.corpus(persons)
    write_jsonl(out / "corpus.jsonl", rows)
    asked = entities.questions(persons, "train")
    write_jsonl(out / "train.jsonl", entities.rows(asked))
    write_jsonl(out / "test.jsonl", entities.rows(entities.questions(persons, "test")))
    spec = _spec(search_task)
    traces = entities.traces(asked, persons, spec.prompt.template, topk=spec.tools.search_topk, seed=seed)
    write_jsonl(out / "traces.jsonl", traces)
    build(BuildConfig(corpus=out / "corpus.jsonl", out=out / "index", index_type="bm25", progress=progress))
    return [t["prompt"] + "".join(s["text"] for s in t["segments"]) for t in traces] + [r["contents"] for r in rows]


@app.command()
def prepare(
    out: Annotated[Path, typer.Argument(help="The directory to create (it must not exist).")] = Path("runs/quickstart"),
    seed: Annotated[int, typer.Option(help="Seed of every generator.")] = 0,
    code_train: Annotated[int, typer.Option(help="Training word problems (and SFT traces).")] = 16000,
    code_test: Annotated[int, typer.Option(help="Held-out word problems.")] = 200,
    people: Annotated[int, typer.Option(help="Fictional people in the corpus (about 10% held out).")] = 1600,
) -> None:
    """Write the quickstart's data, SFT traces, tokenizer, corpus and BM25 index under OUT."""
    try:
        prepare_to(out, seed=seed, code_train=code_train, code_test=code_test, people=people, progress=False)
    except (FileExistsError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}/: code/, search/ (corpus, BM25 index), tokenizer/")


ROWS = [("code", "code_sft", "SFT"), ("code", "code_rl", "SFT + RL"),
        ("search", "search_sft", "SFT"), ("search", "search_rl", "SFT + RL")]


def table_text(root: Path) -> str:
    """The before/after table: for each task and checkpoint whose `<run>/eval/results.json` exists, held-out
    accuracy (mean over samples), tool-call rate and mean turns."""
    lines = ["| task | checkpoint | accuracy | tool-call rate | mean turns |", "|---|---|---|---|---|"]
    for task, run, label in ROWS:
        path = root / run / "eval/results.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())["results"]["task"]
        lines.append(f"| {task} | {label} | {100 * r['pass@1']:.1f}% | {100 * r['tool_call_rate']:.1f}% | "
                     f"{r['turns']:.2f} |")
    if len(lines) == 2:
        raise FileNotFoundError(f"no <run>/eval/results.json under {root} (runs: {', '.join(r for _, r, _ in ROWS)})")
    return "\n".join(lines) + "\n"


@app.command()
def table(root: Annotated[Path, typer.Argument(help="The quickstart's directory.")] = Path("runs/quickstart")) -> None:
    """Print the before/after table of the quickstart's evals."""
    try:
        typer.echo(table_text(root), nl=False)
    except FileNotFoundError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
