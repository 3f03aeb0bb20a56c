"""The training loop: `agentrl train CONFIG`.

    prompts (prompt_order.py: a seeded permutation per epoch; the position is checkpointed)
      -> rollout (the engine generates, tools answer over HTTP) -> rewards on the model's own text
      -> scored groups, taken by the step: stale ones dropped, DAPO's filter (algo/sampling.py)
      -> learn.py: batch.py (packing, old/ref logprobs, values, advantages), PPO epochs x mini-batches
      -> weight_sync.py: the new weights into the engine
      -> metrics.jsonl + TensorBoard, trajectory samples, prompt_stats, checkpoint, validation

One loop serves both modes. A producer (`_produce`) draws prompts one group at a time and rolls each out
and scores it; the step (`_step`) takes scored groups until it has `prompts_per_step` of them, then the
learner trains while the producer goes on. The producer may run `lookahead` steps ahead of the learner's
weights: `trainer.max_staleness` in async mode, where the engine (engine/versioned.py) tags every token
with the policy version that sampled it and takes weight updates between two of its requests, and a group
whose oldest token is more than `max_staleness` versions old is dropped; 0 in sync mode, where each step's
groups are drawn after the previous step's update, all sampled by the same weights. Where the placement
wants it (RunConfig.engine_sleeps: vLLM colocated, sync) the engine sleeps while the learner trains.

A run resumes from its run directory's latest checkpoint with the same data order and the same sampling
seeds; on the HF engine a synchronous run then samples what the uninterrupted run would have (README:
where vLLM differs).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

from agentrl.algo.sampling import DynamicSampler, Scored, StepIntake
from agentrl.build import run_tokenizer
from agentrl.config import write_resolved
from agentrl.engine.process import ProcessEngine
from agentrl.engine.versioned import VersionedEngine
from agentrl.eval.evaluate import answer_format, evaluate
from agentrl.placement import place
from agentrl.prompt_order import PromptSampler
from agentrl.rewards import close_reward, score, task_reward
from agentrl.rollout import ErroredSteps, rollout, rollout_metrics
from agentrl.run_config import RunConfig
from agentrl.run_dir import MetricsLog, RunDir
from agentrl.samples import dump_trajectories, whole_groups
from agentrl.services import Services
from agentrl.task import Task
from agentrl.tools import build_tools
from agentrl.tools.formats import build_format
from agentrl.types import Group, Prompt
from agentrl.weight_sync import PushProbe, push_checked, transport


def sampling_seed(seed: int, index: int, per_step: int) -> int:
    """The rollout seed of the `index`-th group drawn, by the step it is drawn for: a resumed run samples
    what the uninterrupted one did."""
    return seed * 1_000_003 + (index // per_step + 1) * 101


def split_prompts(config: RunConfig, tokenizer: Any) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, validation prompts): eval_task's, or the last `eval_holdout` of the task's."""
    t = config.trainer
    prompts = list(Task(config.task, source="task").prompts(tokenizer))
    holdout = t.eval_holdout if config.eval_task is None and t.eval_every else 0
    if holdout >= len(prompts):
        raise ValueError(f"trainer.eval_holdout ({holdout}) leaves no training prompts of {len(prompts)}")
    held = (prompts[len(prompts) - holdout:] if holdout else
            list(Task(config.eval_task, source="eval_task").prompts(tokenizer)) if config.eval_task is not None else [])
    train = prompts[: len(prompts) - holdout]
    if not train:
        raise ValueError("task: the dataset gives no training prompts (after budgets.max_prompt_tokens)")
    return train, held


class Trainer:
    """A run, ready to go from its run directory's latest checkpoint; `run()` trains to the last step."""

    def __init__(self, config: RunConfig, *, engine: Any = None,
                 on_step_start: Callable[[int], None] | None = None) -> None:
        t, spec = config.trainer, config.task
        self.config, self.on_step_start = config, on_step_start
        self.run_dir = RunDir(config.run_dir)
        self.tokenizer = run_tokenizer(config)
        self.train_prompts, self.eval_prompts = split_prompts(config, self.tokenizer)
        self.total_steps = t.steps or math.ceil(t.epochs * len(self.train_prompts) / t.prompts_per_step)
        config.learner.optim = config.learner.optim.for_run(self.total_steps)  # a cosine ends at the last step
        if config.critic is not None:
            config.critic.optim = config.critic.optim.for_run(self.total_steps)
        self.run_dir.create()
        self.learner, self.engine, self.placement = place(config, self.run_dir.root, self.tokenizer, engine)
        self.probe = (PushProbe(self.train_prompts[0], t.probe_tokens, config.rollout.temperature,
                                t.probe_tolerance, transport(config)) if t.probe_tokens else None)
        self.errored = ErroredSteps(t.max_errored_frac, t.max_errored_steps)
        self.lookahead = t.max_staleness if t.mode == "async" else 0
        self.sleeps = config.engine_sleeps
        chunk = t.chunk_tokens if t.mode == "async" else None  # async: updates wait for a token boundary only
        revive = self._revive_engine if isinstance(self.engine, ProcessEngine) else None
        self.rollout_engine = VersionedEngine(self.engine, self.tokenizer, chunk, timeout_s=config.engine.request_timeout_s,
                                              revive=revive)
        self.learning = asyncio.Lock()  # held while the learner's weights change
        self.fmt = build_format(spec.tools.format, tokenizer=self.tokenizer, names=spec.tools.all_names,
                                observation_max_chars=spec.budgets.observation_max_chars)
        task = Task(spec, source="task")
        task.tool_schemas  # noqa: B018 - every tool checked now (a function standing in for a service too)
        self.environments = task.environments  # the task's environment class, if any
        self.reward = task_reward(spec.reward, spec.tools.workers)
        self.services = Services(list(spec.tools.names), config.services, self.run_dir.root / "logs")
        self.tools = build_tools(self.services.urls, spec.tools.search_topk, self.services.sandbox_token,
                                 config.services.tool_retries, spec.tools.functions, spec.tools.workers,
                                 spec.tools.mcp)
        self.queue: asyncio.Queue[Scored | BaseException] = asyncio.Queue()
        self.room = asyncio.Condition()  # notified when groups leave the window the producer may fill
        self.step, self.sampler, self.drawn = self._resume()
        self.open = 0  # groups drawn and not yet dropped or trained on
        self.log = MetricsLog(self.run_dir, config.logging, self.step, self.total_steps, config)

    # -- the run ------------------------------------------------------------------------------------

    async def run(self) -> RunDir:
        write_resolved(self.config, self.run_dir.root)
        await self._push()  # the engine starts from the learner's weights
        try:
            with self.services, self.log:
                background = [asyncio.create_task(self._produce()), asyncio.create_task(self.services.watch())]
                try:
                    while self.step < self.total_steps:
                        self.step += 1
                        self.log(self.step, await self._step())
                except Exception as e:
                    e.add_note(f"(training step {self.step} of {self.total_steps}; run dir {self.run_dir.root})")
                    self.config.note_out_of_memory(e)
                    raise
                finally:
                    for task in background:
                        task.cancel()
                    await asyncio.gather(*background, return_exceptions=True)
        finally:
            try:
                for tool in self.tools.values():
                    await tool.aclose()
            finally:
                close_reward(self.reward)
        if self.config.trainer.export:
            self.learner.export(str(self.run_dir.export), self.tokenizer)
        return self.run_dir

    async def aclose(self) -> None:
        await self.engine.aclose()
        if self.placement is not None:
            self.learner.close()
            self.placement.close()

    async def _step(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.services.revive()
        if self.on_step_start is not None:
            self.on_step_start(self.step)
        groups, taken = await self._take()
        metrics |= self._rollout_metrics(groups, taken, start)
        trainable = self.errored.check(groups, self.step)  # errored trajectories are out of the loss (batch.py)
        metrics |= await self._sleep(True)
        if trainable:
            async with self.learning:
                metrics |= await asyncio.to_thread(self.learner.learn, groups)  # the producer goes on meanwhile
        metrics |= await self._sleep(False)
        metrics |= await self._push()
        metrics |= self._record(groups)
        if self.config.trainer.eval_every and self.eval_prompts and self._due(self.config.trainer.eval_every):
            metrics |= await self._validate()
        async with self.room:  # the step is done: room for the next step's groups
            self.open -= len(taken.kept)
            self.room.notify_all()
        metrics["timing/step"] = time.perf_counter() - start
        return metrics

    # -- rollout: the producer and the step's side of the queue ---------------------------------------

    async def _produce(self) -> None:
        """Draw a group whenever the window has room: groups drawn and not yet dropped or trained on stay
        within `lookahead + 1` steps' worth (with 0, each step's groups are drawn after the previous step's
        update)."""
        per_step = self.config.trainer.prompts_per_step
        running: set[asyncio.Task] = set()
        try:
            while True:
                async with self.room:
                    await self.room.wait_for(lambda: self.open < (self.lookahead + 1) * per_step)
                    index, self.drawn, self.open = self.drawn, self.drawn + 1, self.open + 1
                [(epoch, prompt)] = self.sampler.take(1)
                task = asyncio.create_task(self._one_group(index, epoch, prompt))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _one_group(self, index: int, epoch: int, prompt: Prompt) -> None:
        """Roll out and score one group. Its requests go before those of groups drawn for later steps
        (`Sampling.priority`): the lookahead takes only the engine capacity the next step's groups leave."""
        t = self.config.trainer
        seed = sampling_seed(t.seed, index, t.prompts_per_step)
        try:
            [group] = await rollout([prompt], engine=self.rollout_engine, fmt=self.fmt, tools=self.tools,
                                    budgets=self.config.task.budgets, tokenizer=self.tokenizer,
                                    config=self.config.rollout.model_copy(update={"seed": seed}),
                                    priority=index // t.prompts_per_step, environments=self.environments)
            await score(group.trajectories, self.reward, self.tokenizer)
            await self.queue.put((index, epoch, prompt, group))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the step's side raises it
            await self.queue.put(e)

    async def _take(self) -> tuple[list[Group], StepIntake]:
        """The step's groups: the first `prompts_per_step` to arrive that are fresh enough and (with DAPO's
        dynamic sampling) informative, in draw order. Without one informative group in `max_rounds` steps'
        worth, the first `prompts_per_step` fresh ones (their group advantages are zero: only the KL and
        entropy terms move the policy)."""
        t, ds = self.config.trainer, self.config.algo.dynamic_sampling
        taken = StepIntake(self.rollout_engine.version, DynamicSampler(t.prompts_per_step, ds.max_rounds))
        tick = self.log.rollout_started(t.prompts_per_step * self.config.rollout.n)
        while len(taken.kept) < t.prompts_per_step and not (ds.enabled and taken.sampler.exhausted):
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if not taken.add(item, self.lookahead, ds.enabled):
                async with self.room:  # dropped: room for another
                    self.open -= 1
                    self.room.notify_all()
            tick(len(item[3].trajectories))
        self._log_prompt_stats(taken.all)
        kept = taken.kept or taken.fresh[: t.prompts_per_step]
        return [g for *_, g in sorted(kept, key=lambda item: item[0])], taken

    def _rollout_metrics(self, groups: list[Group], taken: StepIntake, start: float) -> dict[str, float]:
        metrics = rollout_metrics([tr for *_, g in taken.all for tr in g.trajectories])
        metrics["timing/rollout"] = time.perf_counter() - start  # the learner's wait for groups
        if self.config.algo.dynamic_sampling.enabled:
            metrics |= taken.sampler.stats() | {"rollout/groups_kept": float(len(taken.kept)),
                                                "rollout/dynamic_sampling_fallback": float(not taken.kept)}
        if self.config.trainer.mode == "async":
            trajectories = [tr for g in groups for tr in g.trajectories]
            lags = [taken.version - v for tr in trajectories for v in tr.versions]
            metrics |= {"async/staleness_mean": sum(lags) / max(len(lags), 1),
                        "async/staleness_max": float(max(lags, default=0)),
                        "async/dropped_stale": float(len(taken.stale)),
                        "async/dropped_uninformative": float(len(taken.fresh) - len(taken.kept)),
                        "async/partial_trajectories": sum(len(set(tr.versions)) > 1 for tr in trajectories)
                        / len(trajectories),
                        "async/paused_requests": float(self.rollout_engine.stats["paused_requests"])}
        return metrics

    def _log_prompt_stats(self, taken: list[Scored]) -> None:
        """Every group the step took, dropped ones too: LIMR's scores (lim.py) need each prompt's accuracy
        in each epoch, not a filtered set."""
        records = []
        for _, epoch, prompt, group in sorted(taken, key=lambda item: item[0]):
            parts = [tr.reward.parts.get("correct", 0.0) for tr in group.trajectories if tr.reward]
            records.append({"step": self.step, "epoch": epoch, "prompt_id": prompt.id, "n": len(parts),
                            "correct": sum(parts) / max(len(parts), 1),
                            "mean_reward": sum(tr.reward.score for tr in group.trajectories if tr.reward)
                            / max(len(group.trajectories), 1)})
        self.run_dir.log_prompt_stats(records)

    # -- weights, and the engine's memory ------------------------------------------------------------

    async def _push(self) -> dict[str, float]:
        """The learner's weights (its version: the steps done) into the engine, once no request is in flight
        (async: the wait for the requests in flight to reach their chunk's end is timing/update_wait)."""
        metrics = await self.rollout_engine.update(lambda: push_checked(
            self.learner, self.engine, self.probe, self.step, self.config.trainer.push_timeout_s), version=self.step)
        drain = self.rollout_engine.last_drain
        metrics["timing/update_wait"] = drain["wait_s"]
        if isinstance(self.engine, ProcessEngine):
            metrics["engine/restarts"] = float(self.engine.restarts)
        if self.config.trainer.mode == "async":
            metrics["async/drained_requests"] = float(drain["requests"])
        return metrics

    async def _revive_engine(self) -> None:
        """The engine process died: start it again and give it the learner's weights, once the learner is
        between steps (they are then the last pushed, or the step's about to be)."""
        if self.engine.restarts >= self.config.engine.max_restarts:
            raise RuntimeError(f"the engine process died again after {self.engine.restarts} restarts "
                               "(engine.max_restarts): the run stops")
        await self.engine.restart()
        async with self.learning:
            await push_checked(self.learner, self.engine, self.probe, self.step, self.config.trainer.push_timeout_s)

    async def _sleep(self, asleep: bool) -> dict[str, float]:
        """Free the engine's GPU memory for the learner (`asleep`), or take it back, where it sleeps."""
        if not self.sleeps:
            return {}
        start = time.perf_counter()
        await self.rollout_engine.control(
            lambda: self.engine.sleep(self.config.engine.sleep_level) if asleep else self.engine.wake())
        return {f"timing/{'sleep' if asleep else 'wake'}": time.perf_counter() - start}

    # -- what a step leaves: samples, checkpoints, validation -------------------------------------------

    def _due(self, every: int) -> bool:
        return self.step == self.total_steps or bool(every and self.step % every == 0)

    def _record(self, groups: list[Group]) -> dict[str, float]:
        """The step's trajectory samples, and its checkpoint where due."""
        t = self.config.trainer
        if t.samples_per_step:  # whole groups, so a prompt's samples can be compared (agentrl view)
            dump_trajectories(self.run_dir.samples / f"step_{self.step}.jsonl",
                              whole_groups(groups, t.samples_per_step), self.tokenizer)
        if not self._due(t.save_every):
            return {}
        start = time.perf_counter()
        state = {"step": self.step, "data": self.sampler.state, "drawn": self.drawn}
        self.run_dir.save_checkpoint(self.step, state, lambda tmp: self.learner.save(str(tmp), state),
                                     t.keep_checkpoints)
        return {"timing/checkpoint": time.perf_counter() - start}

    def _resume(self) -> tuple[int, PromptSampler[Prompt], int]:
        """(step, data order, groups drawn) from the run dir's latest checkpoint, if it has one."""
        t = self.config.trainer
        found = self.run_dir.resume()
        if found is None:
            return 0, PromptSampler(self.train_prompts, t.seed), 0
        path, state = found
        self.learner.load(str(path))
        step, data = int(state["step"]), state["data"]
        sampler = PromptSampler(self.train_prompts, int(data["seed"]), int(data["epoch"]), int(data["index"]))
        return step, sampler, int(state.get("drawn", step * t.prompts_per_step))

    async def _validate(self) -> dict[str, float]:
        t = self.config.trainer
        start = time.perf_counter()
        spec = self.config.eval_task or self.config.task
        result = await evaluate(self.eval_prompts, engine=self.rollout_engine, fmt=self.fmt, tools=self.tools,
                                budgets=spec.budgets, tokenizer=self.tokenizer, reward=self.reward, n=t.eval_n,
                                temperature=t.eval_temperature, seed=t.seed, answer_format=answer_format(spec.reward.name),
                                environments=self.environments)
        return result.metrics | {"timing/validation": time.perf_counter() - start}


def train(config: RunConfig, **kwargs: Any) -> RunDir:
    """Run `config` to its last step (resuming from its run dir's latest checkpoint, if any)."""
    async def main() -> RunDir:
        trainer = Trainer(config, **kwargs)
        try:
            return await trainer.run()
        finally:
            await trainer.aclose()

    return asyncio.run(main())
