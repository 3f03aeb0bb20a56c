"""A run on Ray (placement.py decides it): the placement group, the learner's ranks and the engine
replicas as actors, each holding the same objects the one-process trainer builds (learn.Learner; build.py's
engines). Ray only places them.

    Placement: the run's placement group, formed once the cluster (joined or started by `connect`) has room;
        `Layout` says which bundle holds which actor and how many GPUs it asks for there.

    RayLearner: learn.Learner's interface over `learner_ranks` _LearnerRank actors; each rank a Learner whose
        FSDP2 process group is formed from Ray (rank 0's node address and a free port; gloo on CPUs, NCCL on
        GPUs), no torchrun. Every Learner method is collective, so the driver calls it on all ranks with the
        same arguments (the step's scored groups go into Ray's object store once) and takes rank 0's answer.
    RayEngine: the Engine interface of one _EngineActor (an engine in an actor, one per replica; a vLLM one
        optionally tensor-parallel), pooled by the trainer behind engine/pool.py's EnginePool.

A rank or an engine that dies fails the call that was waiting on it with Ray's error, which names the
actor; the run stops and resumes from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any

from agentrl.build import build_engine, build_lm
from agentrl.engine import Completion, Sampling, maybe_await
from agentrl.engine.weights import load_bucket, weights_loaded
from agentrl.learn import Learner
from agentrl.run_config import RunConfig
from agentrl.task import load_tokenizer
from agentrl.weight_sync import WeightBroadcast, push_from_rank, transport


class Layout:
    """Where the run's actors go: the placement group's bundles, and for each learner rank and engine the
    bundle it takes and the GPUs it asks for there. Colocated vLLM engines (and split ones with
    `share_gpus`) share bundle i, one GPU, with learner rank i, half each; otherwise every actor has a
    bundle of its own: a GPU per learner rank on CUDA, `engine.tensor_parallel_size` per vLLM engine (or a
    GPU per transformers engine on CUDA)."""

    def __init__(self, config: Any) -> None:
        p, e = config.placement, config.engine
        learner_gpu = float(config.learner.device == "cuda" or e.kind == "vllm")  # vLLM: on CUDA (validated)
        if p.shares_gpus(e.kind):
            self.bundles = [{"CPU": 2.0, "GPU": 1.0} for _ in range(p.learner_ranks)]
            self.ranks = [(i, 0.5) for i in range(p.learner_ranks)]
            self.engines = [(i, 0.5) for i in range(p.engines)]
            return
        engine_gpus = float(e.tensor_parallel_size if e.kind == "vllm" else e.device == "cuda")
        self.bundles = ([_bundle(learner_gpu) for _ in range(p.learner_ranks)]
                        + [_bundle(engine_gpus) for _ in range(p.engines)])
        self.ranks = [(i, learner_gpu) for i in range(p.learner_ranks)]
        self.engines = [(p.learner_ranks + j, engine_gpus) for j in range(p.engines)]

    def needs(self) -> dict[str, float]:
        return {k: sum(b.get(k, 0.0) for b in self.bundles) for k in ("CPU", "GPU")}


def _bundle(gpus: float) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": gpus} if gpus else {"CPU": 1.0}


def ray_wait(refs: Any, what: str, timeout_s: float) -> Any:
    """ray.get(refs), bounded: past `timeout_s`, an error naming `what` and the key that sets the bound."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"{what} did not finish within {timeout_s:g} s (placement.call_timeout_s)") from None


class Placement:
    """The run's placement group (a Layout), formed once the cluster has room for it."""

    def __init__(self, config: Any) -> None:
        from ray.util.placement_group import placement_group

        self.layout = Layout(config)
        want = self.layout.needs()
        want["CPU"] += service_actors(config)  # outside the group, but on the same cluster
        connect(config, want)
        self.group = placement_group(self.layout.bundles, strategy="PACK")
        ray_wait(self.group.ready(), "forming the run's placement group", config.placement.call_timeout_s)

    def options(self, bundle: int, gpus: float, **extra: Any) -> dict[str, Any]:
        """Ray actor options for an actor in `bundle` with `gpus` GPUs (a CPU always)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": 1, "num_gpus": gpus, **extra, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=bundle)}

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def service_actors(config: Any) -> int:
    """The auto services' actors (a CPU each) a run with services.on_ray starts: those its task's tools need."""
    s = config.services
    if not s.on_ray:
        return 0
    tools = set(config.task.tools.names)
    return (s.sandbox_replicas if "python" in tools and s.sandbox == "auto" else 0) + int(
        "search" in tools and s.retriever == "auto")


def connect(config: Any, want: dict[str, float]) -> Any:
    """Join the Ray cluster at placement.ray_address ("auto": the one this machine belongs to), or start a
    local one with a logical CPU per actor at least; a cluster short of what the actors take is an error
    naming both (Ray would wait for the resources forever)."""
    import ray

    from agentrl.config import ConfigError

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
                          f"({config.placement.learner_ranks} learner ranks, {config.placement.engines} engines, "
                          f"{config.placement.mode}, {service_actors(config)} service actors); the Ray cluster has {have.get('CPU', 0):g} CPUs and "
                          f"{have.get('GPU', 0):g} GPUs")
    return ray


class _LearnerRank:
    """One learner rank in an actor: a learn.Learner once `setup` has joined the process group."""

    def address(self) -> tuple[str, int]:
        import ray

        from agentrl.learner.fsdp import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, config: dict[str, Any], rank: int, world: int, master: tuple[str, int]) -> None:
        os.environ |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                       "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        self.rank = rank
        cfg = RunConfig.model_validate(config)
        self.learner = Learner(cfg, build_lm(cfg))
        self.broadcast: Any = None

    def join_weight_group(self, host: str, port: int, world: int) -> None:
        self.broadcast = WeightBroadcast(host, port, world)

    def learn(self, groups: list[Any]) -> dict[str, float]:
        return self.learner.learn(groups)

    def score(self, trajectory: Any) -> list[float]:
        return self.learner.score(trajectory)

    def push(self, actors: list[Any], how: str) -> int:
        return push_from_rank(self.learner.policy, self.rank, actors, how, self.broadcast)

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self.learner.save(path, extra)

    def load(self, path: str) -> None:
        self.learner.load(path)

    def export(self, path: str, tokenizer: str) -> None:
        self.learner.export(path, load_tokenizer(tokenizer, option="model.tokenizer"))


class RayLearner:
    """learn.Learner's interface over `placement.learner_ranks` Ray actors (see the module docstring)."""

    def __init__(self, config: Any, placement: Placement) -> None:
        import ray

        self.config = config
        ranks = config.placement.learner_ranks
        actor = ray.remote(_LearnerRank)
        self.ranks = [actor.options(**placement.options(b, gpus, **_shared_gpu_nccl(config, None))).remote()
                      for b, gpus in placement.layout.ranks]
        master = ray_wait(self.ranks[0].address.remote(), "starting learner rank 0", config.placement.call_timeout_s)
        dump = config.model_dump(mode="json")
        self._all("setup", dump, None, ranks, master, per_rank=True)
        self.transport = transport(config)

    def _all(self, method: str, *args: Any, per_rank: bool = False) -> list[Any]:
        """`method(*args)` on every rank (with `per_rank`, the None argument is the rank's index); rank
        order answers, or an error naming the rank that died."""
        import ray

        refs = [getattr(r, method).remote(*(i if per_rank and a is None else a for a in args))
                for i, r in enumerate(self.ranks)]
        waiting, timeout = list(refs), self.config.placement.call_timeout_s
        while waiting:  # as each rank answers: a dead rank leaves the others blocked in a collective
            done, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if not done:
                raise RuntimeError(f"learner rank {refs.index(waiting[0])} (a _LearnerRank actor) did not return from "
                                   f"{method} within {timeout:g} s (placement.call_timeout_s)")
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise RuntimeError(f"learner rank {refs.index(done[0])} (a _LearnerRank actor) died during "
                                   f"{method}: {type(e).__name__}; the run resumes from its last checkpoint") from e
        return ray.get(refs)

    def join(self, engines: Sequence[RayEngine]) -> None:
        """Split placement: form the NCCL weight group of rank 0 and every engine's workers (rank 0 first,
        then `tensor_parallel_size` ranks per engine, in order); the members join together."""

        tp = self.config.engine.tensor_parallel_size
        timeout = self.config.placement.call_timeout_s
        host, port = ray_wait(self.ranks[0].address.remote(), "learner rank 0's address", timeout)
        world = 1 + tp * len(engines)
        ray_wait([self.ranks[0].join_weight_group.remote(host, port, world)]
                 + [e.actor.join_weight_group.remote(host, port, world, 1 + tp * j) for j, e in enumerate(engines)],
                 "forming the NCCL weight group of learner rank 0 and the engines", timeout)

    def learn(self, groups: list[Any]) -> dict[str, float]:
        import ray

        return self._all("learn", ray.put(groups))[0]

    def score(self, trajectory: Any) -> list[float]:
        return self._all("score", trajectory)[0]

    async def push(self, engine: Any) -> dict[str, float]:
        """The policy's weights into the run's engines (an EnginePool of RayEngines, as `place` makes it); in a
        thread, so the event loop stays free and trainer.push_timeout_s can end the wait."""
        start = time.perf_counter()
        sent = await asyncio.to_thread(self._all, "push", [e.actor for e in engine.engines], self.transport)
        return {"timing/weight_sync": time.perf_counter() - start, "sync/bytes": float(sent[0])}

    def save(self, path: str, extra: dict[str, Any]) -> None:
        self._all("save", path, extra)

    def load(self, path: str) -> None:
        self._all("load", path)

    def export(self, path: str, tokenizer: Any) -> None:
        self._all("export", path, self.config.model.tokenizer or self.config.model.path)

    def close(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)


class _EngineActor:
    """An engine in an actor: a transformers one started from the run's initial weights, or a vLLM one
    from `model_dir` (the checkpoint, or the random init the driver wrote); the learner's first push
    replaces them either way."""

    def __init__(self, config: dict[str, Any], seed: int, model_dir: str | None) -> None:
        cfg = RunConfig.model_validate(config)
        # tensor-parallel vLLM workers as vLLM's own processes, not Ray actors: this actor's GPUs are Ray's grant
        extra = {"distributed_executor_backend": "mp"} if cfg.engine.kind == "vllm" and cfg.engine.tensor_parallel_size > 1 else {}
        self.engine: Any = build_engine(cfg, seed=seed, model_dir=model_dir, own_process=False, **extra)

    def max_context_tokens(self) -> int | None:
        return self.engine.max_context_tokens

    async def generate(self, prompt_ids: list[int], sampling: Sampling, session: str | None) -> Completion:
        return await self.engine.generate(prompt_ids, sampling, session=session)

    async def load_weight_bucket(self, payload: bytes) -> int | None:
        return await load_bucket(self.engine, payload)

    async def load_ipc_bucket(self, handle: bytes, layout: list) -> int:
        return await self.engine.load_ipc_bucket(handle, layout)

    async def join_weight_group(self, host: str, port: int, world: int, offset: int) -> None:
        await self.engine.join_weight_group(host, port, world, offset)

    async def receive_bucket(self, layout: list, nbytes: int) -> int:
        return await self.engine.receive_bucket(layout, nbytes)

    async def weights_loaded(self) -> None:
        await weights_loaded(self.engine)

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level)

    async def wake(self) -> None:
        await self.engine.wake()

    async def shutdown(self) -> None:
        await maybe_await(self.engine.aclose())


class RayEngine:
    """The Engine interface (engine/__init__.py) of one _EngineActor."""

    def __init__(self, actor: Any, max_context_tokens: int | None, index: int = 0) -> None:
        self.actor = actor
        self.max_context_tokens = max_context_tokens
        self.index = index

    async def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"engine replica {self.index} (an _EngineActor) died: {e.__class__.__name__}; the "
                               "run resumes from its last checkpoint") from e

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        return await self._call("generate", prompt_ids, sampling, session)

    async def sleep(self, level: int = 1) -> None:
        await self._call("sleep", level)

    async def wake(self) -> None:
        await self._call("wake")

    async def aclose(self) -> None:
        import ray

        try:  # a vLLM engine ends its own processes; a dead actor has nothing left to end
            await self.actor.shutdown.remote()
        except ray.exceptions.RayActorError:
            pass
        ray.kill(self.actor)


# NCCL carries a broadcast between two processes on one GPU over TCP sockets: more of them per connection
# than its default (one) lifts the rate (bench/bench_weight_broadcast.py). Both ends take the same setting;
# a value already in the environment wins.
SHARED_GPU_SOCKETS = {"NCCL_NSOCKS_PERTHREAD": "4", "NCCL_SOCKET_NTHREADS": "4"}


def _shared_gpu_nccl(config: Any, host_id: str | None) -> dict[str, Any]:
    """Actor options for a member of the weight group where split engines share the learner's GPUs
    (`share_gpus`), none otherwise: NCCL refuses two members of one group on one GPU of one host, so an
    engine takes an NCCL host id of its own (`host_id`; the learner keeps the machine's) and NCCL treats
    the two as hosts apart, over sockets (SHARED_GPU_SOCKETS)."""
    p = config.placement
    if not (config.engine.kind == "vllm" and p.mode == "split" and p.share_gpus):
        return {}
    env = {k: os.environ.get(k, v) for k, v in SHARED_GPU_SOCKETS.items()}
    return {"runtime_env": {"env_vars": env | ({"NCCL_HOSTID": host_id} if host_id else {})}}


def ray_engines(config: Any, placement: Placement, model_dir: str | None) -> list[RayEngine]:
    """The run's engine actors (replica i samples with seed trainer.seed + i), as Engine clients."""
    import ray

    dump = config.model_dump(mode="json")
    actors = []
    for j, (bundle, gpus) in enumerate(placement.layout.engines):
        # max_concurrency: a rollout's requests in flight at once
        extra: dict[str, Any] = {"max_concurrency": 4096} | _shared_gpu_nccl(config, f"agentrl-engine-{j}")
        actor = ray.remote(_EngineActor).options(**placement.options(bundle, gpus, **extra))
        actors.append(actor.remote(dump, config.trainer.seed + j, model_dir))
    limits = ray_wait([a.max_context_tokens.remote() for a in actors], f"starting the {len(actors)} engine actors "
                      "(_EngineActor)", config.placement.call_timeout_s)
    return [RayEngine(a, limit, i) for i, (a, limit) in enumerate(zip(actors, limits, strict=True))]
