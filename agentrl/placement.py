"""Placement on Ray: the learner's ranks and the rollout engines as Ray actors, the same objects the
one-process trainer builds (trainer.Learner, engine/hf.py's HFEngine); Ray only places them.

    driver (trainer.Trainer: prompts, rollout, rewards, tools over HTTP, logs, checkpoints' metadata)
      -> RayEngine clients behind engine/pool.py's EnginePool (a trajectory's turns stick to one engine)
           -> _EngineActor: an engine in an actor, one per replica
      -> RayLearner: `learner_ranks` _LearnerRank actors in one placement group, one bundle each
           -> each rank: a trainer.Learner whose FSDP2 process group is formed from Ray (rank 0's node
              address and a free port; gloo on CPUs, NCCL on GPUs), no torchrun

Every Learner method is collective, so the driver calls it on all ranks with the same arguments (the
step's scored groups go into Ray's object store once) and takes rank 0's answer: the learner reduces its
metrics over the ranks itself. Weights go from the learner to the engines without passing the driver:
every rank gathers the full tensors one at a time (the collective part), rank 0 encodes each bucket once
(safetensors) and every engine loads it. A checkpoint is the one-process run's format (the sharded part
is torch.distributed.checkpoint, loadable on another number of ranks), so either kind of run resumes the
other's.

A rank or an engine that dies fails the call that was waiting on it with Ray's error, which names the
actor; the run stops and resumes from its last checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from agentrl.engine import Completion, Sampling, bucket_by_bytes, bucket_bytes


def needs(config: Any) -> dict[str, float]:
    """What the run's actors take: a CPU each, and a GPU each for those on CUDA."""
    p = config.placement
    gpus = p.learner_ranks * (config.learner.device == "cuda") + p.engines * (config.engine.device == "cuda")
    return {"CPU": float(p.learner_ranks + p.engines), "GPU": float(gpus)}


def connect(config: Any) -> Any:
    """Join the Ray cluster at placement.ray_address ("auto": the one this machine belongs to), or start a
    local one with a logical CPU per actor at least; a cluster short of what the actors take is an error
    naming both (Ray would wait for the resources forever)."""
    import ray

    from agentrl.config import ConfigError

    want = needs(config)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False}
        address = config.placement.ray_address
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, int(want["CPU"])), **kwargs)
    have = ray.cluster_resources()
    short = {k: v for k, v in want.items() if v > have.get(k, 0.0)}
    if short:
        raise ConfigError(f"placement: the actors need {want['CPU']:g} CPUs and {want['GPU']:g} GPUs "
                          f"({config.placement.learner_ranks} learner ranks, {config.placement.engines} engines); "
                          f"the Ray cluster has {have.get('CPU', 0):g} CPUs and {have.get('GPU', 0):g} GPUs")
    return ray


def _resources(device: str) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": 1.0} if device == "cuda" else {"CPU": 1.0}


class _LearnerRank:
    """One learner rank in an actor: a trainer.Learner once `setup` has joined the process group."""

    def address(self) -> tuple[str, int]:
        import ray

        from agentrl.learner.fsdp import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, config: dict[str, Any], rank: int, world: int, master: tuple[str, int]) -> None:
        from agentrl.run import RunConfig
        from agentrl.trainer import Learner, build_lm

        os.environ |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                       "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        self.rank = rank
        cfg = RunConfig.model_validate(config)
        self.learner = Learner(cfg, build_lm(cfg))

    def learn(self, groups: list[Any]) -> dict[str, float]:
        return self.learner.learn(groups)

    def push(self, engines: list[Any]) -> None:
        import ray

        state = self.learner.policy.state_for_sync()  # collective: every rank gathers every tensor
        if self.rank != 0:
            for _ in state:
                pass
            return
        for bucket in bucket_by_bytes(state):
            payload = ray.put(bucket_bytes(bucket))
            ray.get([e.load_weight_bucket.remote(payload) for e in engines])
        ray.get([e.weights_loaded.remote() for e in engines])

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.learner.save(path, extra)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def export(self, path: str, tokenizer: str) -> None:
        from agentrl.task import load_tokenizer

        self.learner.export(path, load_tokenizer(tokenizer, option="model.tokenizer"))


class RayLearner:
    """trainer.Learner's interface over `ranks` Ray actors (see the module docstring)."""

    def __init__(self, config: Any, ranks: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        device = config.learner.device
        self.group = placement_group([_resources(device)] * ranks, strategy="PACK")
        ray.get(self.group.ready())
        actor = ray.remote(_LearnerRank)
        self.ranks = [actor.options(
            num_cpus=1, num_gpus=1 if device == "cuda" else 0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
        ).remote() for i in range(ranks)]
        master = ray.get(self.ranks[0].address.remote())
        dump = config.model_dump(mode="json")
        ray.get([r.setup.remote(dump, i, ranks, master) for i, r in enumerate(self.ranks)])

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        waiting = list(refs)
        while waiting:  # as each rank answers: a dead rank leaves the others blocked in a collective
            done, waiting = ray.wait(waiting, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"learner rank {refs.index(done[0])} (a _LearnerRank actor) died during "
                                   f"{method}: {type(e).__name__}; the run resumes from its last checkpoint") from e
        return ray.get(refs)

    def learn(self, groups: list[Any]) -> dict[str, float]:
        import ray

        return self._all("learn", ray.put(groups))[0]

    async def push(self, engines: Sequence[Any]) -> dict[str, float]:
        import time

        start = time.perf_counter()
        actors = [e.actor for pool in engines for e in getattr(pool, "engines", [pool])]
        self._all("push", actors)
        return {"timing/weight_sync": time.perf_counter() - start}

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self._all("save", path, extra)

    def load(self, path: str) -> None:
        self._all("load", path)

    def export(self, path: str, tokenizer: Any) -> None:
        self._all("export", path, self.config.model.tokenizer or self.config.model.path)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.group)


class _EngineActor:
    """A transformers engine (engine/hf.py) in an actor, started from the run's initial weights (the
    learner's first push replaces them)."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        import torch

        from agentrl.engine.hf import HFEngine
        from agentrl.run import RunConfig
        from agentrl.task import load_tokenizer
        from agentrl.trainer import build_lm

        cfg = RunConfig.model_validate(config)
        device = cfg.engine.device
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.path or "", option="model.tokenizer")
        self.engine = HFEngine(build_lm(cfg).to(device), tokenizer, max_batch=cfg.engine.max_batch, seed=seed)

    def max_context_tokens(self) -> int | None:
        return self.engine.max_context_tokens

    async def generate(self, prompt_ids: list[int], sampling: Sampling, session: str | None) -> Completion:
        return await self.engine.generate(prompt_ids, sampling, session=session)

    async def load_weight_bucket(self, payload: bytes) -> int:
        from safetensors.torch import load

        tensors = load(payload)
        await self.engine.update_weights(tensors.items())
        return len(tensors)

    def weights_loaded(self) -> None:
        return None


class RayEngine:
    """The Engine interface (engine/__init__.py) of one _EngineActor."""

    def __init__(self, actor: Any, max_context_tokens: int | None, index: int = 0) -> None:
        self.actor = actor
        self.max_context_tokens = max_context_tokens
        self.index = index

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        import ray

        try:
            return await self.actor.generate.remote(prompt_ids, sampling, session)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"engine replica {self.index} (an _EngineActor) died: {e.__class__.__name__}; the "
                               "run resumes from its last checkpoint") from e

    async def load_weight_bucket(self, payload: bytes) -> int:
        return await self.actor.load_weight_bucket.remote(payload)

    async def weights_loaded(self) -> None:
        await self.actor.weights_loaded.remote()

    async def aclose(self) -> None:
        import ray

        ray.kill(self.actor)


def ray_engines(config: Any, count: int) -> list[RayEngine]:
    """`count` engine actors (engine replica i samples with seed trainer.seed + i), as Engine clients."""
    import ray

    device = config.engine.device
    gpu = 1 if device == "cuda" else 0
    actor = ray.remote(_EngineActor).options(num_cpus=1, num_gpus=gpu)
    dump = config.model_dump(mode="json")
    actors = [actor.remote(dump, config.trainer.seed + i) for i in range(count)]
    limits = ray.get([a.max_context_tokens.remote() for a in actors])
    return [RayEngine(a, limit, i) for i, (a, limit) in enumerate(zip(actors, limits, strict=True))]
