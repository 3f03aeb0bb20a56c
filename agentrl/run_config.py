"""The run config: one YAML file drives a run.

`RunConfig` composes the stage configs that already exist: the task spec (task.py), the rollout's
sampling (rollout.RolloutConfig), the algorithm (algo.AlgoConfig) and the learner (learner.LearnerConfig),
plus what only a run has: the model, the engine, the trainer's schedule, the services and logging.
`load_run_config` reads the YAML, inlines a task named by path (`task: tasks/torl_math.yaml`, or
`task: {base: tasks/torl_math.yaml, dataset: {...}}` to change some of its keys), so that
`--set task.dataset.path=...` works like any other key, and validates it. A value that two stages must agree on is set in one place and
derived everywhere else (`_derive`); giving it a second, different value is an error naming both keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from agentrl.algo import AlgoConfig
from agentrl.config import (
    StrictModel,
    apply_overrides,
    read_yaml,
    validate,
)
from agentrl.learner.config import LearnerConfig, LoraSpec
from agentrl.rollout import RolloutConfig
from agentrl.task_spec import TaskSpec


class ModelConfig(StrictModel):
    """The policy's starting weights: a local HF checkpoint or a hub name (`path`), or a transformers
    config dict with random weights (`config`, for tests and the quickstart)."""

    path: str | None = None
    config: dict[str, Any] | None = Field(None, description="transformers config kwargs, model_type included")
    tokenizer: str | None = Field(None, description="tokenizer dir or hub name; default: path")
    init_seed: int = Field(0, description="seed of the random initialisation (config only)")
    lora: LoraSpec | None = Field(None, description="train LoRA adapters on the frozen model instead of all its "
                                  "weights (learner/lora.py); the engines serve base + adapter")

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
    max_restarts: int = Field(10, ge=0, description="an engine in a process of its own that dies is started "
                              "again with the learner's weights, this many times in a run at most")
    request_timeout_s: float = Field(1800.0, gt=0, description="an engine request (a turn, or an async chunk) "
                                     "that does not answer within this stops the run, naming the engine")


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
    samples_per_step: int = Field(8, ge=0, description="trajectories dumped to samples/step_N.jsonl: whole "
                                  "groups, the fewest that hold at least this many")
    export: bool = Field(True, description="write the final policy as an HF checkpoint to export/")
    mode: Literal["sync", "async"] = Field(
        "sync", description="async: rollout keeps generating while the learner trains (bounded staleness)")
    max_staleness: int = Field(1, ge=0, description="async: a group is trained on only if its oldest token was "
                               "sampled at most this many policy versions before the learner's; 0: synchronous")
    chunk_tokens: int = Field(256, ge=1, description="async: new tokens per engine request; a weight update "
                              "waits for at most this many tokens of each trajectory in flight")
    max_skipped_in_a_row: int = Field(8, ge=1, description="optimizer steps in a row whose loss or gradient is "
                                      "not finite (each skipped and counted) before the run stops")
    max_errored_frac: float = Field(0.25, ge=0, le=1, description="a step with a larger share of errored "
                                    "trajectories (a tool's service failed) logs a warning")
    max_errored_steps: int = Field(5, ge=1, description="that many such steps in a row stop the run")
    push_timeout_s: float = Field(900.0, gt=0, description="a weight push (and its check) that does not finish "
                                  "within this stops the run, naming the transport")
    probe_tokens: int = Field(32, ge=0, description="after every weight push the engine samples this many tokens "
                              "of a fixed probe and the learner scores them; 0: no check")
    probe_tolerance: float | None = Field(None, gt=0, description="the most the engine's and the learner's "
                                          "logprobs of the probe may differ (mean over its tokens) before the "
                                          "push counts as failed; default: by engine.kind (PROBE_TOLERANCE)")

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
    watch_interval_s: float = Field(1.0, ge=0, description="how often, during a step, the trainer checks that its "
                                    "auto services are alive and starts a dead one again; 0: only between steps")
    tool_retries: int = Field(5, ge=0, description="how often a tool call is sent again when its service did not "
                              "take it (a refused connection, a 5xx or 429), the wait doubling from 0.25 s (sandbox) "
                              "or 0.5 s (retriever): 5 outlasts an auto service's restart; then the call is errored")


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
    call_timeout_s: float = Field(7200.0, gt=0, description="a call on the learner's actors (a step, a push, a "
                                  "checkpoint) or the start of an actor, an engine or the placement group that does "
                                  "not finish within this stops the run, naming what was waited for")
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


# The probe's tolerance by engine kind (a mean over its tokens of |engine logprob - learner logprob|): the
# transformers engine computes in the learner's float32; vLLM samples in bfloat16.
PROBE_TOLERANCE = {"hf": 0.01, "vllm": 0.1}
VLLM_MAX_LORA_RANK = 512  # the largest of vLLM's max_lora_rank choices


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
        agree(self.learner, "temperature", self.rollout.temperature, "learner.temperature", "rollout.temperature")
        agree(self.rollout, "seed", self.trainer.seed, "rollout.seed", "trainer.seed")
        agree(self.learner, "seed", self.trainer.seed, "learner.seed", "trainer.seed")
        if self.trainer.probe_tolerance is None:
            object.__setattr__(self.trainer, "probe_tolerance", PROBE_TOLERANCE[self.engine.kind])
        budget = self.task.budgets.max_response_tokens
        overlong = self.algo.overlong
        if overlong.buffer_tokens > 0 or overlong.max_tokens is not None:
            agree(overlong, "max_tokens", budget, "algo.overlong.max_tokens", "task.budgets.max_response_tokens")
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
            agree(self.learner, "model", self.model.path, "learner.model", "model.path")
        if self.model.lora is not None:
            agree(self.learner, "lora", self.model.lora, "learner.lora", "model.lora")
            self._check_lora_engine()
        if self.algo.needs_critic and self.critic is None:
            self.critic = self.learner.model_copy(deep=True)
        for role, learner in (("learner", self.learner), ("critic", self.critic)):
            # the schedules count trainer steps (learner/optim.py): a cosine ends at the run's last step
            if learner is not None and self.trainer.steps is not None and learner.optim.schedule == "cosine":
                agree(learner.optim, "total_steps", self.trainer.steps, f"{role}.optim.total_steps", "trainer.steps")
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

    def _check_lora_engine(self) -> None:
        """What a vLLM engine needs to serve the run's adapter."""
        if self.engine.kind != "vllm":
            return
        if self.model.lora.rank > VLLM_MAX_LORA_RANK:
            raise ValueError(f"model.lora.rank ({self.model.lora.rank}): vLLM serves adapters of rank "
                             f"{VLLM_MAX_LORA_RANK} at most")
        if self.engine.sleep_level == 2:
            raise ValueError("engine.sleep_level 2 drops the engine's weights while the learner trains, and a "
                             "LoRA push (model.lora) sends the adapter only: use sleep_level 1 or 0")

    @property
    def engine_sleeps(self) -> bool:
        """Whether the engine frees its GPU memory while the learner trains: a vLLM engine with sleep_level on,
        sharing the learner's GPU (not split), in sync mode (async rollout goes on while the learner trains)."""
        e = self.engine
        return e.kind == "vllm" and e.sleep_level > 0 and self.placement.mode != "split" and self.trainer.mode == "sync"

    def note_out_of_memory(self, e: BaseException) -> None:
        """Adds memory_advice to a CUDA out-of-memory error, raised in this process or carried (as its message)
        from a learner actor."""
        if type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e):
            e.add_note(self.memory_advice())

    def memory_advice(self) -> str:
        """What to change when the GPU runs out of memory in this run: the engine's share while it stays awake
        beside the learner, and the learner's own memory settings."""
        e, lr = self.engine, self.learner
        parts = []
        if self.placement.shares_gpus(e.kind) and not self.engine_sleeps:
            why = "async mode" if self.trainer.mode == "async" else "engine.sleep_level 0"
            parts.append(f"vLLM stays awake beside the learner ({why}) and holds engine.gpu_memory_utilization "
                         f"({e.gpu_memory_utilization}) of the GPU: lower it")
        parts.append(f"learner.token_budget ({lr.token_budget}) bounds a micro-batch's activations: lower it")
        if not lr.activation_checkpointing:
            parts.append("learner.activation_checkpointing: true recomputes activations in backward instead")
        if lr.logprob_keep_logits:
            parts.append("learner.logprob_keep_logits: false recomputes the logits instead of keeping them")
        return "Out of GPU memory. " + "; ".join(parts) + "."

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir.replace("{name}", self.name))


def agree(model: StrictModel, field: str, value: Any, key: str, source: str) -> None:
    """`model.field` takes `value` from `source`; set to something else as well, it is a contradiction."""
    current = getattr(model, field)
    if field in model.model_fields_set and current != value:
        raise ValueError(f"{key} ({current!r}) contradicts {source} ({value!r}): set it once, in {source}")
    object.__setattr__(model, field, value)  # no re-validation: the value was validated where it was set


def load_run_config(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The run config at `path` with `--set` overrides. `task:` / `eval_task:` may name a task spec file
    (relative to the working directory), in the file or as `--set task=FILE`; its content is inlined before
    the other overrides apply, so `--set task=FILE --set task.budgets.max_turns=4` changes that file's task."""
    data = read_yaml(path)
    rest = []
    for text in overrides:  # `--set task=FILE`: a file to inline (null and a mapping go through as any value)
        key, sep, value = text.partition("=")
        parsed = yaml.safe_load(value) if sep else None
        if sep and key.strip() in ("task", "eval_task") and isinstance(parsed, str):
            data[key.strip()] = parsed
        else:
            rest.append(text)
    overrides = rest
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
