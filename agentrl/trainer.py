"""The training loop: `agentrl train CONFIG`.

    prompts (a seeded permutation per epoch; the position is checkpointed)
      -> rollout (the engine generates, tools answer over HTTP) -> rewards on the model's own text
      -> scored groups (DAPO dynamic sampling: more rounds until enough groups carry a signal)
      -> batch.py: shaping and filters, packing, old/ref logprobs, values, advantages
      -> learner: PPO epochs x mini-batches (policy, and the critic for GAE)
      -> weight_sync: the new weights into the engine
      -> metrics.jsonl + TensorBoard, trajectory samples, prompt_stats, checkpoint, validation

Rollout produces scored groups and the learner consumes them (`Learner.learn`). Synchronously
(`_produce`, `_step`) they take turns, one step each. Asynchronously (`trainer.mode: async`,
`_train_async`) rollout keeps producing while the learner trains, at most `max_staleness + 1` steps of
groups ahead, on the engine behind engine/versioned.py, which tags every token with the policy version that
sampled it and lets weight updates in between two engine requests; a group whose oldest token is more than
`max_staleness` versions behind the learner is dropped. A run resumes from its run directory's latest
checkpoint with the same data order and the same sampling seeds; on the HF engine a synchronous run then
samples what the uninterrupted run would have (README: where vLLM differs).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import torch

from agentrl.algo.sampling import DynamicSampler
from agentrl.batch import build_batch
from agentrl.config import write_resolved
from agentrl.engine import maybe_await
from agentrl.engine.hf import HFEngine
from agentrl.engine.versioned import VersionedEngine
from agentrl.evaluate import answer_format, evaluate
from agentrl.learner.critic import CriticWorker
from agentrl.learner.policy import PolicyWorker
from agentrl.learner.reference import ReferenceWorker
from agentrl.rewards import build_reward, score
from agentrl.rollout import dump_trajectories, rollout, rollout_metrics
from agentrl.run import MetricsLog, RunConfig, RunDir
from agentrl.services import Services
from agentrl.task import Task, load_tokenizer
from agentrl.tools import build_tools
from agentrl.tools.formats import build_format
from agentrl.types import Group, Prompt
from agentrl.weight_sync import push_weights

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Items (prompts; sft.py's trajectories) in a seeded permutation per epoch; `state` (epoch, index,
    seed) resumes the same order."""

    def __init__(self, prompts: Sequence[T], seed: int, epoch: int = 0, index: int = 0) -> None:
        self.prompts, self.seed, self.epoch, self.index = prompts, seed, epoch, index

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[tuple[int, T]]:
        """The next `k` prompts, each with its epoch, across epoch boundaries."""
        out = []
        order = self._order(self.epoch)
        while len(out) < k:
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(self.epoch)
            out.append((self.epoch, self.prompts[order[self.index]]))
            self.index += 1
        return out

    @property
    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}


def build_lm(config: RunConfig) -> torch.nn.Module:
    """The policy's starting weights in float32: the checkpoint, or a seeded random init of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    if m.path is not None:
        return AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.float32)
    kwargs = dict(m.config or {})
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(m.init_seed)
    return AutoModelForCausalLM.from_config(hf_config).float()


def vllm_engine(config: RunConfig, model_dir: str, own_process: bool = False, **overrides: Any) -> Any:
    """The run's vLLM engine (engine.* settings) over the weights in `model_dir`: in this process, or with
    `own_process` in a child process behind the same interface (engine/process.py)."""
    from agentrl.engine.vllm import VLLMEngine

    e = config.engine
    kwargs = dict(model=model_dir, gpu_memory_utilization=e.gpu_memory_utilization, max_model_len=e.max_model_len,
                  enable_sleep_mode=e.sleep_level > 0, enforce_eager=e.enforce_eager,
                  tensor_parallel_size=e.tensor_parallel_size, seed=config.trainer.seed,
                  use_request_seeds=e.request_seeds) | overrides
    if own_process:
        from agentrl.engine.process import ProcessEngine

        return ProcessEngine(VLLMEngine, kwargs)
    return VLLMEngine(**kwargs)


class Learner:
    """The learner's roles in this process: the policy, and the reference and the critic where the algorithm
    needs them, with what a step asks of them. Every method is collective over the learner's ranks: on
    Ray (placement.py) each rank holds one of these and the driver calls them all alike."""

    def __init__(self, config: RunConfig, lm: torch.nn.Module) -> None:
        self.config = config
        algo = config.algo
        self.reference = ReferenceWorker(config.learner, model=copy.deepcopy(lm)) if algo.needs_reference else None
        self.critic = (CriticWorker(config.critic, algo, model=copy.deepcopy(lm))
                       if algo.needs_critic and config.critic else None)
        self.policy = PolicyWorker(config.learner, algo, model=lm)

    def learn(self, groups: list[Group]) -> dict[str, float]:
        """Batch, then PPO epochs over the mini-batches: metrics averaged over the optimizer steps."""
        t, cfg = self.config.trainer, self.config
        start = time.perf_counter()
        step_batch = build_batch(groups, algo=cfg.algo, token_budget=cfg.learner.token_budget,
                                 mini_batches=t.mini_batches, policy=self.policy, reference=self.reference,
                                 critic=self.critic, drop_void_turns=cfg.algo.drop_void_turns,
                                 ppo_epochs=t.ppo_epochs)
        metrics = dict(step_batch.metrics)
        metrics["timing/logprobs"] = time.perf_counter() - start
        start = time.perf_counter()
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(t.ppo_epochs):
            for batch in step_batch.mini_batches:
                out = self.policy.train_step(batch)
                if self.critic is not None:
                    out |= self.critic.train_step(batch)
                for k, v in out.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        for worker in (self.policy, self.critic):  # the schedules count trainer steps
            if worker is not None:
                worker.end_step()
        metrics |= {k: v / steps for k, v in sums.items()}
        metrics["timing/train"] = time.perf_counter() - start
        return metrics

    async def push(self, engines: Sequence[Any]) -> dict[str, float]:
        return await push_weights(self.policy, engines)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.policy.save(f"{path}/actor", extra=extra)
        if self.critic is not None:
            self.critic.save(f"{path}/critic")

    def load(self, path: str) -> None:
        self.policy.load(f"{path}/actor")
        if self.critic is not None:
            self.critic.load(f"{path}/critic")

    def export(self, path: str, tokenizer: Any) -> None:
        self.policy.export_hf(path, tokenizer=tokenizer)


class Trainer:
    def __init__(self, config: RunConfig, *, engine: Any = None,
                 on_step_start: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.run_dir = RunDir(config.run_dir)
        self.on_step_start = on_step_start
        spec = config.task
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.path or "", option="model.tokenizer")
        prompts = list(Task(spec, source="task").prompts(self.tokenizer))
        holdout = config.trainer.eval_holdout if config.eval_task is None and config.trainer.eval_every else 0
        if holdout >= len(prompts):
            raise ValueError(f"trainer.eval_holdout ({holdout}) leaves no training prompts of {len(prompts)}")
        self.eval_prompts = (prompts[len(prompts) - holdout:] if holdout else
                             list(Task(config.eval_task, source="eval_task").prompts(self.tokenizer))
                             if config.eval_task is not None else [])
        self.train_prompts = prompts[: len(prompts) - holdout]
        if not self.train_prompts:
            raise ValueError("task: the dataset gives no training prompts (after budgets.max_prompt_tokens)")
        t = config.trainer
        self.total_steps = t.steps or math.ceil(t.epochs * len(self.train_prompts) / t.prompts_per_step)
        config.learner.optim = config.learner.optim.for_run(self.total_steps)  # a cosine ends at the last step
        if config.critic is not None:
            config.critic.optim = config.critic.optim.for_run(self.total_steps)
        self.sampler = PromptSampler(self.train_prompts, t.seed)

        self.placement = None
        if config.placement.on_ray:
            from agentrl.engine.pool import EnginePool
            from agentrl.placement import Placement, RayLearner, ray_engines

            self.placement = Placement(config)
            model_dir = self._model_dir(None) if config.engine.kind == "vllm" else None
            # engines first: vLLM sizes its memory from what is free on the GPU when it starts
            engines = ray_engines(config, self.placement, model_dir)
            self.engine = engine or EnginePool(engines)
            self.learner: Learner | RayLearner = RayLearner(config, self.placement)
            if config.engine.kind == "vllm" and config.placement.mode == "split":
                self.learner.join(engines)
            self.policy = None
        else:
            self._local(config, engine)
        chunk = t.chunk_tokens if t.mode == "async" else None  # async: updates wait for a token boundary only
        self.rollout_engine = VersionedEngine(self.engine, self.tokenizer, chunk)
        self.fmt = build_format(spec.tools.format, tokenizer=self.tokenizer,
                                observation_max_chars=spec.budgets.observation_max_chars)
        self.reward = build_reward(spec.reward.name, spec.reward.params)
        self.services = Services(list(spec.tools.names), config.services, self.run_dir.root / "logs")
        self.step = 0

    def _local(self, config: RunConfig, engine: Any) -> None:
        """The learner and the engine in this process."""
        t = config.trainer
        lm = build_lm(config)
        # vLLM sizes its memory from what is free when it starts: before the learner takes its share
        self.engine = engine or (self._vllm_engine(lm) if config.engine.kind == "vllm" else None)
        engine_lm = copy.deepcopy(lm) if self.engine is None else None  # before the learner wraps its own copy
        self.learner = Learner(config, lm)
        self.policy = self.learner.policy
        if self.engine is None:
            device = config.engine.device
            device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
            self.engine = HFEngine(engine_lm.to(device), self.tokenizer, max_batch=config.engine.max_batch,
                                   seed=t.seed)

    def _vllm_engine(self, lm: torch.nn.Module) -> Any:
        """A vLLM engine on this GPU, started from the policy's checkpoint or its random init; in a process
        of its own unless engine.own_process is off."""
        return vllm_engine(self.config, self._model_dir(lm), own_process=self.config.engine.own_process)

    def _model_dir(self, lm: torch.nn.Module | None) -> str:
        """What a vLLM engine loads at start (it loads weights from files): model.path, or the random init
        written to <run_dir>/init once (`lm`, or built here), whole or not at all."""
        if self.config.model.path is not None:
            return self.config.model.path
        path = self.run_dir.root / "init"
        if not (path / "config.json").exists():
            tmp = path.with_name("init.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            (lm if lm is not None else build_lm(self.config).to(torch.bfloat16)).save_pretrained(tmp)  # engines load bf16
            self.tokenizer.save_pretrained(tmp)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
        return str(path)

    async def _sleep(self, asleep: bool) -> dict[str, float]:
        """Free the engine's GPU memory for the learner (`asleep`), or take it back (vLLM, colocated)."""
        level = self.config.engine.sleep_level
        if self.config.engine.kind != "vllm" or not level or self.config.placement.mode == "split":
            return {}
        start = time.perf_counter()
        await (self.engine.sleep(level) if asleep else self.engine.wake())
        return {f"timing/{'sleep' if asleep else 'wake'}": time.perf_counter() - start}

    # -- the run ------------------------------------------------------------------------------------

    async def run(self) -> RunDir:
        self.run_dir.create()
        self._resume()
        write_resolved(self.config, self.run_dir.root)
        await self._push()  # the engine starts from the learner's weights
        with self.services, self._logger() as log:
            self.log = log
            self.tools = build_tools(self.services.urls, self.config.task.tools.search_topk,
                                     self.services.sandbox_token)
            try:
                if self.config.trainer.mode == "async":
                    await self._train_async(log)
                while self.step < self.total_steps:
                    self.step += 1
                    metrics = await self._step()
                    log(self.step, metrics)
            finally:
                for tool in self.tools.values():
                    await tool.aclose()
        if self.config.trainer.export:
            self.learner.export(str(self.run_dir.export), self.tokenizer)
        return self.run_dir

    async def aclose(self) -> None:
        await maybe_await(self.engine.aclose())
        if self.placement is not None:
            self.learner.close()
            self.placement.close()

    async def _step(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.services.revive()
        if self.on_step_start is not None:
            self.on_step_start(self.step)
        groups, produced = await self._produce()
        metrics |= produced
        metrics |= await self._sleep(True)
        metrics |= self.learner.learn(groups)
        metrics |= await self._sleep(False)
        metrics |= await self._push()
        return metrics | await self._after_step(groups, start)

    async def _push(self) -> dict[str, float]:
        """The learner's weights (its version: the steps done) into the engine, once no request is in flight
        (async: the wait for the requests in flight to reach their chunk's end is timing/update_wait)."""
        metrics = await self.rollout_engine.update(lambda: self.learner.push([self.engine]), version=self.step)
        drain = self.rollout_engine.last_drain
        metrics = metrics | {"timing/update_wait": drain["wait_s"]}
        if self.config.trainer.mode == "async":
            metrics["async/drained_requests"] = float(drain["requests"])
        return metrics

    async def _after_step(self, groups: list[Group], start: float) -> dict[str, float]:
        """Samples, checkpoint and validation where due, and the step's time since `start`."""
        t = self.config.trainer
        metrics: dict[str, float] = {}
        trajectories = [tr for g in groups for tr in g.trajectories]
        if t.samples_per_step:
            dump_trajectories(self.run_dir.samples / f"step_{self.step}.jsonl", trajectories[: t.samples_per_step],
                              self.tokenizer)
        if self.step == self.total_steps or (t.save_every and self.step % t.save_every == 0):
            metrics["timing/checkpoint"] = self._save()
        if self.eval_prompts and t.eval_every and (self.step == self.total_steps or self.step % t.eval_every == 0):
            metrics |= await self._validate()
        metrics["timing/step"] = time.perf_counter() - start
        return metrics

    async def _produce(self) -> tuple[list[Group], dict[str, float]]:
        """Scored groups for one step: `prompts_per_step` of them (with dynamic sampling: informative ones,
        over at most `max_rounds` rounds of generation)."""
        t, algo = self.config.trainer, self.config.algo
        start = time.perf_counter()
        sampler = DynamicSampler(t.prompts_per_step, algo.dynamic_sampling.max_rounds)
        every: list[Group] = []
        while True:
            drawn = self.sampler.take(sampler.needed if algo.dynamic_sampling.enabled else t.prompts_per_step)
            # sampling seeds by step and round: a resumed step draws what the uninterrupted one drew
            seed = self.config.trainer.seed * 1_000_003 + self.step * 101 + sampler.rounds
            rollout_config = self.config.rollout.model_copy(update={"seed": seed})
            tick = self.log.rollout_started(len(drawn) * rollout_config.n)
            groups = await rollout([p for _, p in drawn], engine=self.rollout_engine, fmt=self.fmt, tools=self.tools,
                                   budgets=self.config.task.budgets, tokenizer=self.tokenizer, config=rollout_config,
                                   on_done=tick)
            score([tr for g in groups for tr in g.trajectories], self.reward, self.tokenizer)
            self._log_prompt_stats(drawn, groups)
            every += groups
            if not algo.dynamic_sampling.enabled:
                kept = groups
                break
            sampler.add(groups)
            if sampler.full or sampler.exhausted:
                kept = sampler.take()
                break
        metrics = rollout_metrics([tr for g in every for tr in g.trajectories])
        metrics["timing/rollout"] = time.perf_counter() - start
        if algo.dynamic_sampling.enabled:
            metrics |= sampler.stats()
            metrics["rollout/groups_kept"] = float(len(kept))
            # no informative group in max_rounds: a step of the usual size (the first round's groups), whose
            # group advantages are all zero, so only the KL and entropy terms move the policy
            metrics["rollout/dynamic_sampling_fallback"] = float(not kept)
            kept = kept or every[: t.prompts_per_step]
        return kept, metrics

    # -- asynchronous training ----------------------------------------------------------------------

    async def _train_async(self, log: MetricsLog) -> None:
        """Rollout keeps producing scored groups (`_produce_ahead`) while the learner trains on earlier ones;
        each step trains on the first `prompts_per_step` groups to finish whose oldest token is at most
        `max_staleness` policy versions behind the learner, dropping (and counting) older ones."""
        t = self.config.trainer
        self._queue: asyncio.Queue[tuple[int, int, Prompt, Group] | BaseException] = asyncio.Queue()
        self._room = asyncio.Condition()
        self._drawn = self.step * t.prompts_per_step  # groups drawn (absolute: seeds follow the index)
        self._discarded = 0
        producer = asyncio.create_task(self._produce_ahead())
        try:
            while self.step < self.total_steps:
                self.step += 1
                log(self.step, await self._step_async())
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    def _may_draw(self) -> bool:
        """Bounded lookahead: groups drawn and not discarded stay within max_staleness + 1 steps past the
        learner's version (with 0, each step's groups are drawn after the previous step's update, as in the
        synchronous trainer)."""
        t = self.config.trainer
        return self._drawn - self._discarded < (self.rollout_engine.version + t.max_staleness + 1) * t.prompts_per_step

    async def _produce_ahead(self) -> None:
        running: set[asyncio.Task] = set()
        try:
            while True:
                async with self._room:
                    await self._room.wait_for(self._may_draw)
                    index = self._drawn
                    self._drawn += 1
                [(epoch, prompt)] = self.sampler.take(1)
                task = asyncio.create_task(self._one_group(index, epoch, prompt))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _one_group(self, index: int, epoch: int, prompt: Prompt) -> None:
        """Roll out and score one group, seeded as the synchronous trainer seeds the step it is drawn for. Its
        requests go before those of groups drawn for later steps (`Sampling.priority`): the lookahead takes
        only the engine capacity that the next step's groups leave, so they finish as soon as they would
        alone, and their tokens are no staler than they need be."""
        t = self.config.trainer
        step = index // t.prompts_per_step  # the step it is drawn for, less one
        seed = t.seed * 1_000_003 + (step + 1) * 101
        try:
            [group] = await rollout([prompt], engine=self.rollout_engine, fmt=self.fmt, tools=self.tools,
                                    budgets=self.config.task.budgets, tokenizer=self.tokenizer,
                                    config=self.config.rollout.model_copy(update={"seed": seed}), priority=step)
            score(group.trajectories, self.reward, self.tokenizer)
            await self._queue.put((index, epoch, prompt, group))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the learner's side raises it
            await self._queue.put(e)

    async def _discard(self) -> None:
        async with self._room:
            self._discarded += 1
            self._room.notify_all()

    async def _step_async(self) -> dict[str, float]:
        t, algo = self.config.trainer, self.config.algo
        start = time.perf_counter()
        metrics = self.services.revive()
        if self.on_step_start is not None:
            self.on_step_start(self.step)
        learner_version = self.rollout_engine.version  # the steps pushed so far
        kept: list[tuple[int, int, Prompt, Group]] = []
        scored: list[tuple[int, int, Prompt, Group]] = []  # every group taken from the queue, dropped ones too
        stale = uninformative = 0
        while len(kept) < t.prompts_per_step:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            scored.append(item)
            versions = [v for tr in item[3].trajectories for v in tr.versions]
            if learner_version - min(versions, default=learner_version) > t.max_staleness:
                stale += 1
                await self._discard()
            elif algo.dynamic_sampling.enabled and len({tr.reward.score for tr in item[3].trajectories if tr.reward}) < 2:
                uninformative += 1  # DAPO dynamic sampling: all rewards equal, no signal
                await self._discard()
            else:
                kept.append(item)
        kept.sort(key=lambda item: item[0])  # draw order, as the synchronous trainer batches them
        metrics["timing/rollout"] = time.perf_counter() - start  # the learner's wait for groups
        groups = [g for *_, g in kept]
        # every scored group, stale and uninformative ones too, as the synchronous trainer records every
        # group it draws: LIMR's scores (lim.py) need each prompt's accuracy in each epoch, not a filtered set
        scored.sort(key=lambda item: item[0])
        self._log_prompt_stats([(epoch, prompt) for _, epoch, prompt, _ in scored], [g for *_, g in scored])
        trajectories = [tr for g in groups for tr in g.trajectories]
        metrics |= rollout_metrics(trajectories)
        lags = [learner_version - v for tr in trajectories for v in tr.versions]
        metrics |= {"async/staleness_mean": sum(lags) / max(len(lags), 1), "async/staleness_max": float(max(lags, default=0)),
                    "async/dropped_stale": float(stale), "async/dropped_uninformative": float(uninformative),
                    "async/partial_trajectories": sum(len(set(tr.versions)) > 1 for tr in trajectories) / len(trajectories),
                    "async/paused_requests": float(self.rollout_engine.stats["paused_requests"])}
        metrics |= await asyncio.to_thread(self.learner.learn, groups)  # rollout goes on meanwhile
        metrics |= await self._push()
        async with self._room:
            self._room.notify_all()  # a new version: room for more groups
        return metrics | await self._after_step(groups, start)

    async def _validate(self) -> dict[str, float]:
        t = self.config.trainer
        start = time.perf_counter()
        spec = self.config.eval_task or self.config.task
        result = await evaluate(self.eval_prompts, engine=self.rollout_engine, fmt=self.fmt, tools=self.tools,
                                budgets=spec.budgets, tokenizer=self.tokenizer, reward=self.reward, n=t.eval_n,
                                temperature=t.eval_temperature, seed=t.seed, answer_format=answer_format(spec.reward.name))
        return result.metrics | {"timing/validation": time.perf_counter() - start}

    # -- state --------------------------------------------------------------------------------------

    def _save(self) -> float:
        start = time.perf_counter()
        tmp = self.run_dir.begin_checkpoint(self.step)
        data = {"step": self.step, "data": self.sampler.state}
        self.learner.save(str(tmp), data)
        self.run_dir.commit_checkpoint(tmp, self.step, data, self.config.trainer.keep_checkpoints)
        return time.perf_counter() - start

    def _resume(self) -> None:
        """Continue from the run dir's latest checkpoint, if it has one."""
        path = self.run_dir.latest_checkpoint()
        if path is None:
            return
        state = json.loads((path / "trainer.json").read_text())
        self.learner.load(str(path))
        self.step = int(state["step"])
        data = state["data"]
        self.sampler = PromptSampler(self.train_prompts, int(data["seed"]), int(data["epoch"]), int(data["index"]))
        self.run_dir.truncate_logs(self.step)

    def _log_prompt_stats(self, drawn: list[tuple[int, Prompt]], groups: list[Group]) -> None:
        records = []
        for (epoch, prompt), group in zip(drawn, groups, strict=True):
            parts = [tr.reward.parts.get("correct", 0.0) for tr in group.trajectories if tr.reward]
            records.append({"step": self.step, "epoch": epoch, "prompt_id": prompt.id, "n": len(parts),
                            "correct": sum(parts) / max(len(parts), 1),
                            "mean_reward": sum(tr.reward.score for tr in group.trajectories if tr.reward)
                            / max(len(group.trajectories), 1)})
        self.run_dir.log_prompt_stats(records)

    def _logger(self) -> MetricsLog:
        return MetricsLog(self.run_dir, self.config.logging, self.step, self.total_steps, self.config)


def train(config: RunConfig, **kwargs: Any) -> RunDir:
    """Run `config` to its last step (resuming from its run dir's latest checkpoint, if any)."""
    async def main() -> RunDir:
        trainer = Trainer(config, **kwargs)
        try:
            return await trainer.run()
        finally:
            await trainer.aclose()

    return asyncio.run(main())
