"""The run directory a run writes, and where its metrics go.

`RunDir`: the resolved `config.yaml`, `metrics.jsonl` (and TensorBoard events), `samples/step_N.jsonl`,
`prompt_stats.jsonl`, `checkpoints/step_N/` with a `latest` marker, `export/`. Every file is written whole
(a temporary file renamed into place) or appended one whole line per write, so a run killed at any moment
leaves nothing half-written; a resumed run drops the lines of the steps it redoes. `MetricsLog` sends a
step's metrics to metrics.jsonl, TensorBoard, W&B, MLflow and the progress bars.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.config import ConfigError, StrictModel, atomic_write_text, read_jsonl, write_jsonl

if TYPE_CHECKING:
    from agentrl.run_config import LoggingConfig


class RunDir:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.checkpoints = self.root / "checkpoints"
        self.samples = self.root / "samples"
        self.metrics_path = self.root / "metrics.jsonl"
        self.prompt_stats_path = self.root / "prompt_stats.jsonl"
        self.export = self.root / "export"

    def create(self) -> None:
        for d in (self.root, self.checkpoints, self.samples):
            d.mkdir(parents=True, exist_ok=True)

    # -- append-only logs: one whole line per write ----------------------------------------------------

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        append_jsonl(self.metrics_path, [{"step": step, **metrics}])

    def log_prompt_stats(self, records: list[dict[str, Any]]) -> None:
        append_jsonl(self.prompt_stats_path, records)

    def truncate_logs(self, last_step: int) -> None:
        """Keep only the lines of steps <= `last_step` (a resumed run redoes the steps after it)."""
        for path in (self.metrics_path, self.prompt_stats_path):
            if path.exists():
                kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
                write_jsonl(path, kept)

    # -- checkpoints --------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint `latest` names, if it is complete (it is written after its directory is)."""
        marker = self.checkpoints / "latest"
        if not marker.exists():
            return None
        path = self.checkpoints / marker.read_text().strip()
        if not (path / "trainer.json").exists():
            raise ConfigError(f"{marker}: names {path.name}, which is not a complete checkpoint")
        return path

    def save_checkpoint(self, step: int, state: dict[str, Any], write: Callable[[Path], None], keep: int) -> None:
        """Checkpoint `step`: `write(directory)` fills a fresh temporary directory (the learner's part), then
        the trainer's `state` is written and the directory renamed into place; `keep` are kept. A write that
        fails (a full disk) leaves the latest checkpoint as it was and raises, naming it."""
        tmp = self.begin_checkpoint(step)
        try:
            write(tmp)
            self.commit_checkpoint(tmp, step, state, keep)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            latest = self.latest_checkpoint()
            raise RuntimeError(f"the checkpoint of step {step} could not be written to {self.checkpoints} "
                               f"({type(e).__name__}: {e}); the latest whole checkpoint is still "
                               f"{latest.name if latest else 'none'}, which a resumed run continues from") from e

    def resume(self) -> tuple[Path, dict[str, Any]] | None:
        """(the latest checkpoint, its trainer state), the logs' lines of later steps dropped (the run redoes
        them); None for a fresh run."""
        path = self.latest_checkpoint()
        if path is None:
            return None
        state = json.loads((path / "trainer.json").read_text())
        self.truncate_logs(int(state["step"]))
        return path, state

    def begin_checkpoint(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint of `step` (`commit_checkpoint` makes it real)."""
        tmp = self.checkpoints / f".step_{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp: Path, step: int, trainer_state: dict[str, Any], keep: int) -> Path:
        """Write the trainer's state, rename `tmp` into `step_N`, point `latest` at it, prune old ones."""
        atomic_write_text(tmp / "trainer.json", json.dumps(trainer_state, indent=1) + "\n")
        final = self.checkpoint_dir(step)
        if final.exists():  # a step redone after a resume from an earlier checkpoint
            shutil.rmtree(final)
        tmp.rename(final)
        atomic_write_text(self.checkpoints / "latest", final.name + "\n")
        done = sorted((p for p in self.checkpoints.glob("step_*") if (p / "trainer.json").exists()),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[:-keep]:
            shutil.rmtree(old)
        for leftover in self.checkpoints.glob(".step_*.tmp"):  # from a run killed while saving
            shutil.rmtree(leftover)
        return final


def append_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Append `records` as JSON lines in one write: a process killed meanwhile leaves whole lines only."""
    if not records:
        return
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class MetricsLog:
    """Where a step's metrics go: metrics.jsonl (one line per step), TensorBoard, W&B and MLflow where
    configured, and progress bars with ETAs (the steps, and the trajectories of the rollout in flight). A
    resumed run continues the same W&B / MLflow run (its id is kept in the run dir)."""

    def __init__(self, run_dir: RunDir, logging: LoggingConfig, start_step: int, total: int,
                 config: StrictModel) -> None:
        self.run_dir, self.logging, self.start, self.total, self.config = run_dir, logging, start_step, total, config

    def __enter__(self) -> MetricsLog:
        self.writer = self.wandb = self.mlflow = self.bar = None
        if self.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # events of steps a resumed run redoes are purged, as metrics.jsonl's lines are
            self.writer = SummaryWriter(str(self.run_dir.root / "tensorboard"), purge_step=self.start + 1)
        name = getattr(self.config, "name", "run")
        if self.logging.wandb_project:
            wandb = _tracker("wandb", "logging.wandb_project")
            run_id = self._tracker_id("wandb", lambda: uuid.uuid4().hex[:12])
            self.wandb = wandb.init(project=self.logging.wandb_project, name=name, id=run_id, resume="allow",
                                    dir=str(self.run_dir.root), config=self.config.model_dump(mode="json"))
        if self.logging.mlflow_tracking_uri:
            mlflow = _tracker("mlflow", "logging.mlflow_tracking_uri")
            mlflow.set_tracking_uri(self.logging.mlflow_tracking_uri)
            mlflow.set_experiment(self.logging.mlflow_experiment)
            saved = self.run_dir.root / "mlflow_run_id"
            run = mlflow.start_run(run_id=saved.read_text().strip() if saved.exists() else None, run_name=name)
            atomic_write_text(saved, run.info.run_id + "\n")
            self.mlflow = mlflow
        if self.logging.progress:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), transient=False)
            self.bar.start()
            self.task = self.bar.add_task("steps", total=self.total, completed=self.start)
            self.rollout_task = self.bar.add_task("rollout", total=1, visible=False)
        return self

    def _tracker_id(self, tracker: str, new: Callable[[], str]) -> str:
        path = self.run_dir.root / f"{tracker}_run_id"
        if not path.exists():
            atomic_write_text(path, new() + "\n")
        return path.read_text().strip()

    def rollout_started(self, trajectories: int) -> Callable[[int], None]:
        """Show a step's rollout of `trajectories`; returns the tick to call with each count that arrives."""
        if self.bar is None:
            return lambda done: None
        self.bar.reset(self.rollout_task, total=trajectories, visible=True, description="rollout")
        return lambda done: self.bar.advance(self.rollout_task, done)

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.run_dir.log_metrics(step, metrics)
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics(metrics, step=step)
        if self.bar is not None:
            shown = next(((name, metrics[k]) for k, name in (("reward/mean", "reward"), ("sft/nll", "nll")) if k in metrics),
                         None)
            label = f"steps ({shown[0]} {shown[1]:+.3f})" if shown else "steps"
            self.bar.update(self.task, completed=step, description=label)

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
        if self.bar is not None:
            self.bar.stop()


def _tracker(module: str, key: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{key} is set but {module} is not installed: pip install 'agentrl[tracking]'") from None
