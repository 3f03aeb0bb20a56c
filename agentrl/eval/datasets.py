"""The evaluation benchmarks by name: where each one's rows are and how its answers are read and graded.

`BENCHMARKS` is the one table (the README repeats it). A benchmark is read from a local copy under
`--data-dir` (the file names of a `shared/data`-style folder: math/*.jsonl, qa/*.json) or, where a hub copy
with known fields exists, from the Hugging Face hub. Either way it becomes the task spec's `dataset`
section (task.py), so rows, field mapping, the `\\boxed{}` fallback of a solution and answer patterns are
read by the same code as training data.

Answer formats: `boxed` (the last `\\boxed{}` of the response, graded by the `math` reward: normalisation,
exact numbers, then math-verify), `answer-tag` (the last `<answer>` of the response, graded by exact match
after SQuAD normalisation, `qa_em`, with token F1 `qa_f1` reported beside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentrl.config import ConfigError
from agentrl.task_spec import DatasetSpec, Fields


@dataclass(frozen=True)
class Source:
    path: str  # a file under the data dir, or a hub dataset name
    question: str
    answer: str
    solution: str | None = None  # where the answer field is missing: the last \boxed{} of this one
    id: str | None = None
    config: str | None = None
    split: str = "test"
    answer_regex: str | None = None

    def dataset(self, path: str, limit: int | None) -> DatasetSpec:
        fields = Fields(question=self.question, answer=self.answer, solution=self.solution, id=self.id)
        return DatasetSpec(path=path, config=self.config, split=self.split, fields=fields,
                           answer_regex=self.answer_regex, limit=limit)


@dataclass(frozen=True)
class Benchmark:
    name: str
    kind: Literal["math", "qa"]
    local: Source
    hub: Source | None
    answer: str  # the gold answer, in words (for the README's table)


def _flashrag(name: str, config: str, split: str, local: str | None) -> Benchmark:
    hub = Source("RUC-NLPIR/FlashRAG_datasets", "question", "golden_answers", config=config, split=split)
    return Benchmark(name, "qa", Source(local or f"qa/{name}.json", "question", "answer"), hub,
                     "a list of acceptable strings")


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in [
    Benchmark("math500", "math", Source("math/math500.jsonl", "problem", "answer", "solution", "unique_id"),
              Source("HuggingFaceH4/MATH-500", "problem", "answer", "solution", "unique_id"), "LaTeX expression"),
    Benchmark("aime24", "math", Source("math/aime24.jsonl", "problem", "answer", None, "id"),
              Source("HuggingFaceH4/aime_2024", "problem", "answer", None, "id", split="train"), "integer 0-999"),
    Benchmark("aime25", "math", Source("math/aime25.jsonl", "question", "answer"),
              Source("math-ai/aime25", "problem", "answer", None, "id"), "integer 0-999"),
    Benchmark("amc23", "math", Source("math/amc23.jsonl", "problem", "answer", None, "id"), None,
              "number (written as a float)"),
    Benchmark("gsm8k", "math", Source("math/gsm8k_test.jsonl", "question", "answer", answer_regex=r"####\s*(.+)"),
              Source("openai/gsm8k", "question", "answer", config="main", answer_regex=r"####\s*(.+)"),
              "integer after `####` in the solution"),
    Benchmark("olympiadbench", "math", Source("math/olympiadbench.jsonl", "question", "final_answer", None, "id"),
              None, "a list of one LaTeX answer"),
    Benchmark("minerva", "math", Source("math/minerva_math.jsonl", "problem", "answer", "solution", "idx"), None,
              "the last \\boxed{} of the solution"),
    _flashrag("nq", "nq", "test", "qa/nq_test.json"),
    _flashrag("triviaqa", "triviaqa", "test", None),
    _flashrag("popqa", "popqa", "test", None),
    _flashrag("hotpotqa", "hotpotqa", "dev", "qa/hotpotqa_dev.json"),
    _flashrag("2wiki", "2wikimultihopqa", "dev", None),
    _flashrag("musique", "musique", "dev", None),
    _flashrag("bamboogle", "bamboogle", "test", "qa/bamboogle.json"),
]}


def resolve(names: str, data_dir: str | Path | None, limit: int | None,
            task: DatasetSpec | None = None) -> list[tuple[Benchmark, DatasetSpec]]:
    """`names` (comma-separated) -> each benchmark with the dataset section that reads it: the local copy
    under `data_dir` when given (it must be there), else the hub copy. The name `task` is the task spec's
    own dataset (`task`), e.g. a held-out split."""
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name == "task" and task is not None:
            f = task.fields
            source = Source(task.path, f.question, f.answer, f.solution, f.id, task.config, task.split, task.answer_regex)
            out.append((Benchmark("task", "math", source, None, "the task's own"),
                        task.model_copy(update={"limit": limit or task.limit})))
            continue
        if name not in BENCHMARKS:
            raise ConfigError(f"--benchmarks: unknown benchmark {name!r}; expected one of: {', '.join(BENCHMARKS)}, "
                              "or task (the task spec's own dataset)")
        b = BENCHMARKS[name]
        if data_dir is not None:
            path = Path(data_dir) / b.local.path
            if not path.is_file():
                raise ConfigError(f"--data-dir {data_dir}: benchmark {name} expects the file {b.local.path} there")
            out.append((b, b.local.dataset(str(path), limit)))
        elif b.hub is None:
            raise ConfigError(f"--benchmarks: {name} has no hub copy with known fields; pass --data-dir with "
                              f"{b.local.path} in it")
        else:
            out.append((b, b.hub.dataset(b.hub.path, limit)))
    if not out:
        raise ConfigError("--benchmarks: name at least one benchmark")
    return out
