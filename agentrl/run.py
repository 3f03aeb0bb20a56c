"""The run config (one YAML file drives a run) and the run directory it writes.

`RunConfig` composes the stage configs that already exist: the task spec (task.py), the rollout's
sampling (rollout.RolloutConfig), the algorithm (algo.AlgoConfig) and the learner (learner.LearnerConfig),
plus what only a run has: the model, the engine, the trainer's schedule, the services and logging.
`load_run_config` reads the YAML, inlines a task named by path (`task: tasks/torl_math.yaml`, or
`task: {base: tasks/torl_math.yaml, dataset: {...}}` to change some of its keys), so that
`--set task.dataset.path=...` works like any other key, and validates it. A value that two stages must agree on is set in one place and
derived everywhere else (`_derive`); giving it a second, different value is an error naming both keys.

`RunDir` is the run directory: the resolved `config.yaml`, `metrics.jsonl` (and TensorBoard events),
`samples/step_N.jsonl`, `prompt_stats.jsonl`, `checkpoints/step_N/` with a `latest` marker, `export/`.
Every file is written whole (a temporary file renamed into place) or appended one whole line per write,
so a run killed at any moment leaves nothing half-written; a resumed run drops the lines of the steps it
redoes.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.algo import AlgoConfig
from agentrl.config import (
    ConfigError,
    StrictModel,
    apply_overrides,
    atomic_write_text,
    read_jsonl,
    read_yaml,
    validate,
    write_jsonl,
)
from agentrl.learner.config import LearnerConfig
from agentrl.rollout import RolloutConfig
from agentrl.task import TaskSpec


class ModelConfig(StrictModel):
    """The policy's starting weights: a local HF checkpoint or a hub name (`path`), or a transformers
    config dict with random weights (`config`, for tests and the quickstart)."""

    path: str | None = None
    config: dict[str, Any] | None = Field(None, description="transformers config kwargs, model_type included")
    tokenizer: str | None = Field(None, description="tokenizer dir or hub name; default: path")
    init_seed: int = Field(0, description="seed of the random initialisation (config only)")

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of model.path (a checkpoint) or model.config (random weights)")
        if self.config is not None and self.tokenizer is None:
            raise ValueError("model.config (random weights) needs model.tokenizer")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs a model_type, e.g. qwen2")
        return self


class EngineConfig(StrictModel):
    """The rollout engine: `hf` (transformers, CPU or GPU) or `vllm` (one GPU, shared with the learner:
    asleep while the learner trains). Either is kept in step with the learner by in-place weight pushes."""

    kind: Literal["hf", "vllm"] = "hf"
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hf: where the engine runs")
    max_batch: int = Field(64, ge=1, description="hf: requests decoded together")
    gpu_memory_utilization: float = Field(0.4, gt=0, lt=1, description="vllm: its share of the GPU's memory")
    max_model_len: int | None = Field(None, ge=1, description="vllm: context length (default: the model's)")
    enforce_eager: bool = Field(False, description="vllm: no CUDA graphs (starts faster, runs slower)")
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: GPUs per engine replica (split placement)")
    own_process: bool = Field(
        True, description="vllm, placed in the trainer's process (not on Ray, where each engine is an actor): the "
        "engine, with vLLM's frontend that handles every engine step's output, in a child process, so it and the "
        "learner never wait for each other's Python; weights still go by CUDA IPC. false: in the trainer's process")
    sleep_level: Literal[0, 1, 2] = Field(
        1, description="vllm: while the learner trains, 1 frees the KV cache and moves weights to the host, "
        "2 also drops the weights (the push restores them), 0 stays awake")
    request_seeds: bool = Field(
        False, description="vllm: seed every request (by run, step, prompt, sample and turn), so that a resumed "
        "run samples what the uninterrupted one did; vLLM then draws each seeded request's noise on its own, "
        "at a cost per engine step (BENCHMARKS.md). false: the engine's one seeded stream (the hf engine "
        "always seeds per request)")


class TrainerConfig(StrictModel):
    steps: int | None = Field(None, ge=1, description="training steps; or give epochs")
    epochs: int | None = Field(None, ge=1, description="passes over the training prompts; or give steps")
    prompts_per_step: int = Field(8, ge=1)
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's batch")
    mini_batches: int = Field(1, ge=1, description="optimizer steps per PPO epoch (the step's groups split evenly)")
    seed: int = Field(0, description="data order, sampling and initialisation of new heads")
    run_dir: str = Field("runs/{name}", description="{name} is the run's name")
    save_every: int = Field(0, ge=0, description="checkpoint every k steps (and always at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    eval_every: int = Field(0, ge=0, description="validate every k steps (and at the end); 0: never")
    eval_holdout: int = Field(0, ge=0, description="validating without eval_task: the last k prompts, held out")
    eval_n: int = Field(1, ge=1, description="samples per validation prompt")
    eval_temperature: float = Field(0.0, ge=0.0, description="0: greedy")
    samples_per_step: int = Field(8, ge=0, description="trajectories dumped to samples/step_N.jsonl")
    export: bool = Field(True, description="write the final policy as an HF checkpoint to export/")
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollout keeps generating while the learner trains (bounded staleness)")
    max_staleness: int = Field(1, ge=0, description="async: a group is trained on only if its oldest token was "
                               "sampled at most this many policy versions before the learner's; 0: synchronous")
    chunk_tokens: int = Field(256, ge=1, description="async: new tokens per engine request; a weight update "
                              "waits for at most this many tokens of each trajectory in flight")

    @model_validator(mode="after")
    def _one_length(self) -> TrainerConfig:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of trainer.steps or trainer.epochs")
        return self


class ServicesConfig(StrictModel):
    """Where the tools' services are: a URL, or "auto" (the trainer starts one on a free loopback port,
    restarts it if it dies, stops it at exit). Only the services the task's tools need are used."""

    sandbox: str | list[str] = Field("auto", description="auto, a URL, or a list of URLs (calls spread over them)")
    sandbox_args: list[str] = Field([], description="extra `agentrl sandbox serve` arguments for auto")
    sandbox_replicas: int = Field(1, ge=1, description="auto: sandboxes started, calls spread over them")
    sandbox_token: str | None = Field(None, description="the sandbox's bearer token (auto on Ray: one is generated)")
    on_ray: bool = Field(False, description="auto services as Ray actors spread over the cluster's nodes, bound "
                         "to their node's address (a run placed on Ray)")
    retriever: str = "auto"
    retriever_index: str | None = Field(None, description="index dir the auto retriever serves")
    startup_timeout_s: float = Field(300.0, gt=0)


class LoggingConfig(StrictModel):
    tensorboard: bool = Field(True, description="TensorBoard events in <run_dir>/tensorboard")
    wandb_project: str | None = Field(None, description="log to this W&B project (pip install 'agentrl[tracking]')")
    mlflow_tracking_uri: str | None = Field(None, description="log to this MLflow server or store, e.g. http://host:5000")
    mlflow_experiment: str = "agentrl"
    progress: bool = Field(True, description="a progress bar with an ETA on the terminal")


class PlacementConfig(StrictModel):
    """Where the learner and the engines run: in this process (the default), or as Ray actors
    (placement.py): `learner_ranks` data-parallel learner ranks and `engines` engine replicas, vLLM ones
    `colocated` on the learner's GPUs or `split` onto GPUs of their own."""

    ray_address: str | None = Field(None, description="the Ray cluster to join (auto: the one this machine is in); "
                                    "unset on Ray (more than one rank or engine, or split): a local Ray is started")
    learner_ranks: int = Field(1, ge=1, description="learner actors, one per GPU (or CPU), one FSDP2 group")
    engines: int = Field(1, ge=1, description="engine replicas, each an actor; a trajectory sticks to one")
    mode: Literal["colocated", "split"] = Field(
        "colocated", description="vllm engines: colocated, engine i on learner rank i's GPU, asleep while it trains, "
        "weights by CUDA IPC; split, engines on GPUs of their own, awake, weights broadcast over NCCL")
    share_gpus: bool = Field(False, description="split: engine i still shares learner rank i's GPU (separate "
                             "processes, weights over NCCL): the split path where a machine has one GPU")

    @property
    def on_ray(self) -> bool:
        return self.ray_address is not None or self.learner_ranks > 1 or self.engines > 1 or self.mode == "split"

    def shares_gpus(self, engine_kind: str) -> bool:
        """Whether vLLM engine i and learner rank i share a GPU (colocated, or split with share_gpus)."""
        return engine_kind == "vllm" and (self.mode == "colocated" or self.share_gpus)


class RunConfig(StrictModel):
    name: str
    task: TaskSpec
    eval_task: TaskSpec | None = None
    model: ModelConfig
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    learner: LearnerConfig = LearnerConfig()
    critic: LearnerConfig | None = Field(None, description="advantage gae: the critic's settings; default: learner's")
    trainer: TrainerConfig
    services: ServicesConfig = ServicesConfig()
    logging: LoggingConfig = LoggingConfig()
    placement: PlacementConfig = PlacementConfig()

    @model_validator(mode="after")
    def _derive(self) -> RunConfig:
        """Settings two stages read, set once. Each pair is (where it is set, where it is derived)."""
        if self.rollout.temperature <= 0:
            raise ValueError("rollout.temperature must be > 0 for training (greedy samples give no policy "
                             "gradient; validation has its own trainer.eval_temperature)")
        if self.rollout.top_p < 1.0 or self.rollout.top_k > 0:
            raise ValueError(f"rollout.top_p={self.rollout.top_p} / rollout.top_k={self.rollout.top_k}: the "
                             "learner's logprobs are over the whole vocabulary, the engine's over what top-p / "
                             "top-k keep, so the importance ratios would be wrong; train with top_p 1 and top_k 0")
        _agree(self.learner, "temperature", self.rollout.temperature, "learner.temperature", "rollout.temperature")
        _agree(self.rollout, "seed", self.trainer.seed, "rollout.seed", "trainer.seed")
        _agree(self.learner, "seed", self.trainer.seed, "learner.seed", "trainer.seed")
        budget = self.task.budgets.max_response_tokens
        overlong = self.algo.overlong
        if overlong.buffer_tokens > 0 or overlong.max_tokens is not None:
            _agree(overlong, "max_tokens", budget, "algo.overlong.max_tokens", "task.budgets.max_response_tokens")
            if overlong.buffer_tokens > budget:
                raise ValueError(f"algo.overlong.buffer_tokens ({overlong.buffer_tokens}) exceeds the response "
                                 f"budget, task.budgets.max_response_tokens ({budget})")
        if self.algo.loss_agg == "seq_mean_token_sum_norm" and self.algo.loss_norm_tokens is None:
            object.__setattr__(self.algo, "loss_norm_tokens", budget)  # Dr.GRPO's constant: the response budget
        if self.algo.group_relative and self.rollout.n < 2:
            raise ValueError(f"algo.advantage={self.algo.advantage} compares each sample with the others of its "
                             f"prompt's group, so rollout.n must be at least 2 (it is {self.rollout.n}); with one "
                             "sample per prompt use reinforce_pp or gae")
        if self.model.path is not None:
            _agree(self.learner, "model", self.model.path, "learner.model", "model.path")
        if self.algo.needs_critic and self.critic is None:
            self.critic = self.learner.model_copy(deep=True)
        for role, learner in (("learner", self.learner), ("critic", self.critic)):
            # the schedules count trainer steps (learner/optim.py): a cosine ends at the run's last step
            if learner is not None and self.trainer.steps is not None and learner.optim.schedule == "cosine":
                _agree(learner.optim, "total_steps", self.trainer.steps, f"{role}.optim.total_steps", "trainer.steps")
        if self.trainer.eval_every and self.eval_task is None and not self.trainer.eval_holdout:
            raise ValueError("trainer.eval_every needs a validation set: eval_task, or trainer.eval_holdout > 0")
        p = self.placement
        if self.services.on_ray and not p.on_ray:
            raise ValueError("services.on_ray: the services' actors join the run's Ray cluster; place the run on Ray "
                             "(placement.ray_address, or more than one learner rank or engine)")
        if p.shares_gpus(self.engine.kind) and p.on_ray:
            if p.engines != p.learner_ranks or self.engine.tensor_parallel_size != 1:
                raise ValueError(f"placement: vLLM engines sharing the learner's GPUs take one GPU each, engine i on "
                                 f"learner rank i's: give placement.engines = placement.learner_ranks "
                                 f"({p.learner_ranks}, not {p.engines}) and engine.tensor_parallel_size 1 (not "
                                 f"{self.engine.tensor_parallel_size}), or placement.mode split")
        if self.engine.kind == "vllm" and p.on_ray and self.learner.device == "cpu":
            raise ValueError("placement on Ray with vLLM engines: weights reach them from the learner's GPUs; set "
                             "learner.device cuda (not cpu)")
        if self.engine.tensor_parallel_size > 1 and not (p.mode == "split" and self.engine.kind == "vllm"):
            raise ValueError("engine.tensor_parallel_size > 1 needs vLLM engines in placement.mode split")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir.replace("{name}", self.name))


def _agree(model: StrictModel, field: str, value: Any, key: str, source: str) -> None:
    """`model.field` takes `value` from `source`; set to something else as well, it is a contradiction."""
    current = getattr(model, field)
    if field in model.model_fields_set and current != value:
        raise ValueError(f"{key} ({current!r}) contradicts {source} ({value!r}): set it once, in {source}")
    object.__setattr__(model, field, value)  # no re-validation: the value was validated where it was set


def load_run_config(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config at `path` with `--set` overrides. `task:` / `eval_task:` may name a task spec file
    (relative to the working directory); its content is inlined before overrides apply."""
    data = read_yaml(path)
    for key in ("task", "eval_task"):
        spec = data.get(key)
        if isinstance(spec, str):
            data[key] = read_yaml(spec)
        elif isinstance(spec, dict) and "base" in spec:  # a task file with some keys changed
            rest = {k: v for k, v in spec.items() if k != "base"}
            data[key] = _merged(read_yaml(spec["base"]), rest)
    return validate(RunConfig, apply_overrides(data, overrides, RunConfig), str(path))


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied key by key; mappings merge, anything else is replaced."""
    out = dict(base)
    for k, v in changes.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --- the run directory -----------------------------------------------------------------------------------


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

    def rollout_started(self, trajectories: int) -> Callable[[], None] | None:
        """Show a rollout of `trajectories` in flight; returns the tick to call as each one ends."""
        if self.bar is None:
            return None
        self.bar.reset(self.rollout_task, total=trajectories, visible=True, description="rollout")
        return lambda: self.bar.advance(self.rollout_task)

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
