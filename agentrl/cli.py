"""`agentrl`: the one command-line entry point, grouped by job.

Each group lives with its stage and imports heavy modules (torch, transformers, the grader) only inside
the command that needs them, so `agentrl --help` is instant. A subcommand exists here only once it works.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from agentrl.task import Task

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for LLM agents that use tools while they reason (TORL, Search-R1, LIMR).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
tasks_app = typer.Typer(help="Validate, render and check task specs (tasks/*.yaml).", no_args_is_help=True)
app.add_typer(tasks_app, name="tasks")


def _mount_services() -> None:
    # The services' command lines live with the services (they are also `python -m sandbox|retriever`);
    # both import nothing heavy until a command runs.
    from retriever.cli import app as retriever_app
    from sandbox.cli import app as sandbox_app

    app.add_typer(sandbox_app, name="sandbox", help="The code-execution sandbox service (SandboxFusion-compatible).")
    app.add_typer(retriever_app, name="retriever", help="Build and serve retrieval indexes (Search-R1-compatible).")


_mount_services()

SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer reads the annotation at runtime on Python 3.10
    typer.Option("--set", "-s", help="Override a key: --set dataset.path=data.jsonl (repeatable)."),
]
DEFAULT_TOKENIZER = "Qwen/Qwen2.5-0.5B-Instruct"


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@tasks_app.command("validate")
def tasks_validate(
    files: Annotated[list[Path], typer.Argument(help="Task spec files.")],
    overrides: SetOption = None,
    load: Annotated[bool, typer.Option(help="Also load the dataset and resolve every row.")] = False,
) -> None:
    """Check task specs (keys, types, reward parameters, budgets), then their data: that a local dataset
    exists, or which command writes it (dataset.made_by), or with --load every row."""
    from agentrl.config import ConfigError
    from agentrl.task import DataNotPrepared, load_task

    failed = 0
    for path in files:
        # Two steps, reported apart: the spec, then its data. A file that dataset.made_by writes may be
        # missing (a fresh clone has none of them) and the spec is still valid; --load asks for the rows.
        try:
            task = load_task(path, overrides or [])
            schemas = task.tool_schemas  # imports the function tools and checks their schemas
        except ConfigError as e:
            failed += 1
            typer.echo(f"FAIL {e}", err=True)
            continue
        try:
            data = _dataset_state(task, load)
        except DataNotPrepared as e:
            if load:
                failed += 1
                typer.echo(f"FAIL {e}", err=True)
                continue
            data = f"not there yet: `{e.command}` writes it"
        except ConfigError as e:
            failed += 1
            typer.echo(f"FAIL {e}", err=True)
            continue
        s = task.spec
        names = [schema["function"]["name"] for schema in schemas] if s.tools.format == "hermes" else s.tools.all_names
        tools = f"{s.tools.format} {names}" if s.tools.format else "no tools"
        typer.echo(f"ok   {path}: {s.name}; {tools}; reward {s.reward.label}")
        typer.echo(f"     dataset {s.dataset.path}: {data}")
    if failed:
        raise typer.Exit(code=1)


def _dataset_state(task: Task, load: bool) -> str:
    """What `tasks validate` can say of a spec's dataset: its rows (--load), or that the file is there, or
    that a hub dataset is fetched only when read. Raises ConfigError (DataNotPrepared) as Task does."""
    ds = task.spec.dataset
    task.check_dataset()
    if load:
        return f"{len(task.rows())} rows"
    if ds.is_local:
        return "present (--load resolves its rows)"
    hub = ", ".join(f"{k} {v}" for k, v in (("config", ds.config), ("split", ds.split)) if v)
    return f"a hub dataset ({hub}), fetched when first read (--load fetches it now)"


@tasks_app.command("show")
def tasks_show(
    file: Annotated[Path, typer.Argument(help="A task spec file.")],
    n: Annotated[int, typer.Option("-n", min=1, help="How many prompts to render.")] = 3,
    overrides: SetOption = None,
    tokenizer: Annotated[
        str, typer.Option(help="Tokenizer (local dir or hub name) for chat templates and token counts.")
    ] = DEFAULT_TOKENIZER,
    ids: Annotated[bool, typer.Option(help="Also print the token ids.")] = False,
) -> None:
    """Render the first prompts exactly as the model will see them, with token counts; with the hermes format,
    first the schema of each tool the model is shown."""
    from agentrl.config import ConfigError
    from agentrl.task import load_task, load_tokenizer

    try:
        task = load_task(file, overrides or [])
        tok = load_tokenizer(tokenizer)
        prompts = []
        for prompt in task.prompts(tok):
            prompts.append(prompt)
            if len(prompts) == n:
                break
        schemas = task.tool_schemas if task.spec.tools.format == "hermes" else []
    except ConfigError as e:
        raise _fail(str(e)) from None
    for schema in schemas:  # what the chat template renders into the system prompt
        typer.echo(f"──── tool {schema['function']['name']} ────\n{json.dumps(schema, indent=2)}")
    for i, p in enumerate(prompts, 1):
        typer.echo(f"──── prompt {i}/{len(prompts)} · id {p.id} · {len(p.token_ids)} tokens · answer {p.ground_truth!r} ────")
        typer.echo(p.text, nl=False)
        typer.echo("\n──── end of prompt ────")
        if ids:
            typer.echo(f"token ids: {list(p.token_ids)}")
    if task.dropped_too_long:
        typer.echo(f"({task.dropped_too_long} prompts over budgets.max_prompt_tokens were skipped)")


@tasks_app.command("check")
def tasks_check(
    file: Annotated[Path, typer.Argument(help="A task spec file.")],
    field: Annotated[str, typer.Option(help="The dataset field holding a reference response.")] = "solution",
    overrides: SetOption = None,
    out: Annotated[Optional[Path], typer.Option(help="Write config.yaml, results.jsonl, summary.json here.")] = None,  # noqa: UP045
    show_failures: Annotated[int, typer.Option(help="How many failures to list.")] = 20,
) -> None:
    """Grade a reference field of every row (e.g. MATH's `solution`) with the task's reward: a check that answer
    extraction and the grader agree with the dataset before training on it."""
    from rich.console import Console
    from rich.table import Table

    from agentrl.config import ConfigError, atomic_write_text, write_resolved
    from agentrl.rewards import task_reward
    from agentrl.task import load_task

    if out is not None and out.exists() and not out.is_dir():
        raise _fail(f"--out {out}: is a file; expected a directory (it gets config.yaml, results.jsonl, summary.json)")
    try:
        task = load_task(file, overrides or [])
        rows = task.rows()
    except ConfigError as e:
        raise _fail(str(e)) from None
    if task.spec.reward.name == "environment":
        raise _fail(f"{file}: reward 'environment' sums what the task's environment gives as the model plays; "
                    "it grades no text, so there is no reference to check")
    missing = [r.id for r in rows if field not in r.fields]
    if missing:
        raise _fail(f"--field {field!r}: {len(missing)} rows lack it (first: row {missing[0]})")
    reward = task_reward(task.spec.reward)
    results, failures = [], []
    for r in rows:
        res = reward(str(r.fields[field]), r.ground_truth)
        res = asyncio.run(res) if inspect.isawaitable(res) else res  # a user's reward function
        results.append({"id": r.id, "score": res.score, **res.parts, "ground_truth": r.ground_truth})
        if res.parts.get("correct", 0.0) < 1.0:
            failures.append(r)
    n_correct = len(rows) - len(failures)
    fraction = n_correct / len(rows) if rows else 0.0

    console = Console(highlight=False)
    table = Table(title=f"{task.spec.name}: `{field}` graded by reward {task.spec.reward.label!r}")
    for col in ("rows", "correct", "fraction", "mean score"):
        table.add_column(col, justify="right")
    mean = sum(res["score"] for res in results) / len(results) if results else 0.0
    table.add_row(str(len(rows)), str(n_correct), f"{fraction:.4f}", f"{mean:.4f}")
    console.print(table)
    for r in failures[:show_failures]:
        console.print(f"  wrong: row {r.id}: graded {str(r.fields[field])[-80:]!r} against {r.ground_truth!r}", markup=False)
    if out is not None:
        write_resolved(task.spec, out)
        atomic_write_text(out / "results.jsonl", "".join(json.dumps(res) + "\n" for res in results))
        summary = {"task": task.spec.name, "field": field, "rows": len(rows), "correct": n_correct, "fraction": fraction}
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        console.print(f"wrote {out}/config.yaml, results.jsonl, summary.json", markup=False)


@app.command("train")
def train(
    config: Annotated[Path, typer.Argument(help="A run config (configs/*.yaml).")],
    overrides: SetOption = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue the run in this run dir (default: trainer.run_dir, "  # noqa: UP045
                                                   "which resumes by itself when it holds a checkpoint).")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Run the learner ranks and engines on this Ray cluster "  # noqa: UP045
                                                       "(auto: the one this machine is in); placement.ray_address.")] = None,
) -> None:
    """Train a policy with RL: rollouts with tools, rewards, advantages, learner steps, checkpoints."""
    from agentrl.config import ConfigError
    from agentrl.run_config import load_run_config

    sets = list(overrides or [])
    if resume is not None:
        if not (resume / "checkpoints" / "latest").exists():
            raise _fail(f"--resume {resume}: no checkpoint there (expected {resume}/checkpoints/latest)")
        sets.append(f"trainer.run_dir={resume}")
    if ray_address is not None:
        sets.append(f"placement.ray_address={ray_address}")
    try:
        run_config = load_run_config(config, sets)
        from agentrl.trainer import train as run_training

        run_dir = run_training(run_config)
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(f"run dir: {run_dir.root}")


@app.command("sft")
def sft(
    config: Annotated[Path, typer.Argument(help="An SFT config: data, model, learner, trainer.")],
    overrides: SetOption = None,
) -> None:
    """Supervised fine-tuning on trajectories (trainer dumps or chat messages), masked like RL."""
    from agentrl.config import ConfigError, load_model
    from agentrl.sft import SFTConfig
    from agentrl.sft import sft as run_sft

    try:
        run_dir = run_sft(load_model(SFTConfig, config, overrides or []))
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(f"run dir: {run_dir.root}")


@app.command("eval")
def eval_(
    model: Annotated[str, typer.Option(help="An HF checkpoint dir (a run's export/) or a hub name.")],
    task: Annotated[Path, typer.Option(help="The task spec: prompt, tool format, budgets, reward.")] = Path("tasks/torl_math.yaml"),
    benchmarks: Annotated[str, typer.Option(help="Comma-separated benchmark names (README: Evaluation).")] = "math500",
    n: Annotated[int, typer.Option(min=1, help="Samples per problem: pass@k and maj@k for every k <= n.")] = 1,
    temperature: Annotated[float, typer.Option(min=0.0, help="0: greedy.")] = 0.0,
    no_tools: Annotated[bool, typer.Option("--no-tools", help="The same prompts with the tools off.")] = False,
    data_dir: Annotated[Optional[str], typer.Option(help="Local copies (math/*.jsonl, qa/*.json); default: the hub.")] = None,  # noqa: UP045
    out: Annotated[Optional[Path], typer.Option(help="Results dir (resumes what it holds); default runs/eval/<model>.")] = None,  # noqa: UP045
    engine: Annotated[str, typer.Option(help="hf (transformers) or vllm; auto: vllm where a GPU and vLLM are.")] = "auto",
    limit: Annotated[Optional[int], typer.Option(min=1, help="The first N problems of each benchmark.")] = None,  # noqa: UP045
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    sandbox: Annotated[str, typer.Option(help="The sandbox's URL, or auto (started here).")] = "auto",
    retriever: Annotated[str, typer.Option(help="The retriever's URL, or auto (serves --index).")] = "auto",
    index: Annotated[Optional[str], typer.Option(help="Index dir for an auto retriever.")] = None,  # noqa: UP045
    tokenizer: Annotated[Optional[str], typer.Option(help="Default: the model's own.")] = None,  # noqa: UP045
    overrides: SetOption = None,
) -> None:
    """Evaluate a model on benchmarks with the task's tools: pass@k, maj@k, tool use, per-sample records."""
    import asyncio

    from agentrl.config import ConfigError
    from agentrl.eval.run import run_eval, without_tools
    from agentrl.run_config import ServicesConfig
    from agentrl.services import Services
    from agentrl.task import load_task, load_tokenizer

    out = out or Path("runs/eval") / Path(model.rstrip("/")).name
    try:
        spec = load_task(task, overrides or []).spec
        tok = load_tokenizer(tokenizer or model, option="--tokenizer")
        names = without_tools(spec).tools.names if no_tools else spec.tools.names
        services = Services(list(names), ServicesConfig(sandbox=sandbox, retriever=retriever, retriever_index=index),
                            out / "logs")
        with services:
            results = asyncio.run(_evaluate(model, engine, tok, seed, lambda e: run_eval(
                spec=spec, benchmarks=benchmarks, engine=e, tokenizer=tok, out=out, n=n, temperature=temperature,
                seed=seed, data_dir=data_dir, limit=limit, no_tools=no_tools, tool_urls=services.urls)))
    except ConfigError as e:
        raise _fail(str(e)) from None
    from agentrl.eval.run import markdown_table

    typer.echo(markdown_table(results, n), nl=False)
    typer.echo(f"wrote {out}/results.json, results.md and <benchmark>.samples.jsonl")


@app.command("lim")
def lim(
    run_dir: Annotated[Optional[Path], typer.Argument(help="A training run dir (its prompt_stats.jsonl).")] = None,  # noqa: UP045
    rewards_log: Annotated[Optional[Path], typer.Option(help='Instead of a run: JSONL of {"prompt_id", "epoch", "correct"}.')] = None,  # noqa: UP045
    threshold: Annotated[float, typer.Option(help="Keep prompts scoring at least this (LIMR: 0.6).")] = 0.6,
    out: Annotated[Path, typer.Option(help="The selected prompts: dataset rows (a run) or {prompt_id, score}.")] = Path("selected.jsonl"),
    rand_out: Annotated[Optional[Path], typer.Option(help="The RAND baseline; default: OUT's name + .rand.jsonl.")] = None,  # noqa: UP045
    seed: Annotated[int, typer.Option(help="Seed of the RAND baseline.")] = 0,
) -> None:
    """LIMR's data selection: score each prompt's accuracy over the epochs against the run's, keep those
    scoring at least --threshold, and draw a RAND baseline of the same size."""
    from agentrl.config import ConfigError, read_jsonl, write_jsonl
    from agentrl.lim import epoch_accuracies, histogram, lim_scores, run_rows, select

    rand_out = rand_out or out.with_name(out.name.removesuffix(".jsonl") + ".rand.jsonl")
    try:
        if (run_dir is None) == (rewards_log is None):
            raise ConfigError("give a RUN_DIR or --rewards-log FILE (one of them)")
        source = rewards_log or run_dir / "prompt_stats.jsonl"
        accuracies = epoch_accuracies(read_jsonl(source), str(source))
        scores = lim_scores(accuracies)
        chosen, rand = select(scores, threshold, seed)
        if rewards_log is not None:
            universe = len(accuracies)
            write_jsonl(out, [{"prompt_id": p, "score": scores[p]} for p in chosen])
            write_jsonl(rand_out, [{"prompt_id": p, "score": scores[p]} for p in rand])
        else:
            rows = run_rows(run_dir)
            universe = len(rows)
            known = {r.id for r in rows}
            missing = [p for p in scores if p not in known]
            if missing:
                raise ConfigError(f"{source}: prompt {missing[0]!r} (and {len(missing) - 1} more) is not in the run's "
                                  "dataset: was the dataset changed since the run?")
            for path, ids in ((out, set(chosen)), (rand_out, set(rand))):  # rows in the dataset's order
                write_jsonl(path, [r.fields for r in rows if r.id in ids])
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(f"scored {len(scores)} of {universe} prompts ({universe - len(scores)} dropped: not seen in every "
               f"epoch); selected {len(chosen)} with score >= {threshold} -> {out}; RAND {len(rand)} (seed {seed}) "
               f"-> {rand_out}")
    typer.echo(histogram(scores.values()))


@app.command("report")
def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run dirs to plot, overlaid (e.g. LIMR, RAND, full).")],
    out: Annotated[Optional[Path], typer.Option(help="Where the PNGs and report.html go; default: FIRST_RUN/report.")] = None,  # noqa: UP045
    samples: Annotated[int, typer.Option(min=0, help="Samples of each step picked, in the embedded viewer.")] = 64,
) -> None:
    """PNG plots and one self-contained HTML page of training runs: reward, lengths, tool use, losses, timing,
    and the trajectory viewer over a few steps of each."""
    from agentrl.config import ConfigError
    from agentrl.report import render

    try:
        page = render(run_dirs, out or run_dirs[0] / "report", per_step=samples)
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(f"wrote {page} and its PNGs")


@app.command("view")
def view(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run dirs (also while training) or eval dirs.")],
    port: Annotated[int, typer.Option(help="The local port.")] = 8765,
    host: Annotated[str, typer.Option(help="Keep 127.0.0.1; remote: ssh -L 8765:127.0.0.1:8765 <machine>.")] = "127.0.0.1",
) -> None:
    """A local web page of what the agent did, token by token (README: agentrl view)."""
    import uvicorn

    from agentrl.config import ConfigError
    from agentrl.view.server import app_for

    try:
        application = app_for(run_dirs, ("127.0.0.1", "localhost", host))
    except ConfigError as e:
        raise _fail(str(e)) from None
    typer.echo(f"agentrl view: http://{host}:{port}/ (Ctrl-C stops it)")
    uvicorn.run(application, host=host, port=port, log_level="warning")


async def _evaluate(model: str, kind: str, tokenizer: object, seed: int, run: object) -> object:
    """Build the engine (in the running event loop, as vLLM needs), run, close it."""
    from agentrl.build import checkpoint_engine

    engine = checkpoint_engine(kind, model, seed)
    try:
        return await run(engine)  # type: ignore[operator]
    finally:
        await engine.aclose()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
