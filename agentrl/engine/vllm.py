"""The vLLM engine (GPU): `vllm.v1.engine.async_llm.AsyncLLM` behind the `Engine` interface.

Every request is a `TokensPrompt` (token-in), its output the sampled ids with their logprobs
(token-out): stop strings stay in the output (`include_stop_str_in_output=True`) and, where one ends
inside a token, that token comes back whole; rollout.py decodes the ids itself. Logprobs are vLLM's
`processed_logprobs`: log_softmax(logits / temperature), renormalised over the tokens top-k / top-p keep,
as engine/hf.py's.

Prefix caching is on, so turn k+1 of a trajectory (its prompt = turn k's prompt + output + observation)
recomputes only the new tokens. Several replicas are vLLM data-parallel ranks; a trajectory's turns are
routed to one rank by its `session` key (sticky), where its prefix is cached.

Weights are updated in place through a worker extension (vllm_worker.py) called with `collective_rpc`,
in buckets serialised as safetensors bytes (the RPC's msgpack carries bytes, not tensors, in plain
arguments), then the prefix cache is reset. Tensors already on the engine's GPU (a colocated learner's)
go by CUDA IPC instead (`update_weights_on_gpu`): the workers map the sender's flat bucket in place.

`admission_interval_ms` (200 by default; 0 turns it off) holds each new request until the next multiple of
that interval, so that turns ending at staggered times enter the engine together: fewer engine steps then
mix a new turn's prefill into the decode batch (vLLM runs mixed steps without its full decode CUDA
graphs); a turn waits at most one interval more. A request waits for a wave only while at least
`admission_min_in_flight` (32) others are in flight on the engine: at a rollout's tail, where a few long
trajectories are left, there is no batch to gather and a wave would only add its wait to the turns on the
rollout's critical path. While new turns wait, the other trajectories' steps run with fewer sequences,
which costs little where steps are bound by per-sequence host work, as they are for small models. What
waves are worth depends on where the engine runs (BENCHMARKS.md, Rollout): with the engine in the rollout's
own process they raised the async loop's throughput; with engines in processes of their own, waves, no
waves and waves above 32 in flight measured within the runs' spread.

The frontend's per-step work (per running request: detokenising, stop strings, logprobs, stats) is one
Python event loop per engine, and at a rollout's concurrency it saturates its process and falls behind the
engine core. So requests without stop strings skip detokenisation, `log_stats=False` turns off vLLM's
stats there, and `vllm_processes(model, 2)` runs two engines on the GPU, each in a process of its own
(engine/process.py) behind one EnginePool (pool.py), each frontend with half the requests: with two, the
async multi-turn loop keeps close to plain generation's throughput where one engine does not
(BENCHMARKS.md).

Per-request seeds are off by default: vLLM samples seeded requests one generator at a time, a cost the
whole batch pays at every step, and its outputs depend on batch composition anyway; the engine `seed`
fixes the run. `use_request_seeds=True` (a run's `engine.request_seeds`) honours `Sampling.seed`. `sleep()` / `wake()` free and restore GPU memory when
training shares the GPUs. Needs `pip install agentrl[gpu]`.

With `lora` (a run's `model.lora`) the engine serves its base model plus one LoRA adapter through vLLM's
LoRA support (`_Adapter`): a push brings the adapter's tensors only, by the same bucket calls as full weights;
they are written in peft's format to a directory of the engine's own and loaded in place under one adapter
id, so each push replaces the last and vLLM holds one adapter however many pushes came. Until the first
push requests go to the base alone, which is what a fresh adapter (B = 0) computes.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import shutil
import tempfile
import uuid
import weakref
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.engine import BETWEEN_ROLLOUTS, Completion, EngineDied, Sampling, refuse_in_flight
from agentrl.engine.weights import load_buckets, load_ipc_buckets

if TYPE_CHECKING:
    from agentrl.engine.pool import EnginePool

WORKER_EXTENSION = "agentrl.engine.vllm_worker.WeightUpdateExtension"


class VLLMEngine:
    def __init__(self, model: str, *, tensor_parallel_size: int = 1, replicas: int = 1, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, enable_sleep_mode: bool = False,
                 enforce_eager: bool = False, seed: int = 0, attention_backend: str | None = "TRITON_ATTN",
                 max_num_seqs: int = 1024, max_num_batched_tokens: int = 16384, use_request_seeds: bool = False,
                 admission_interval_ms: float = 200.0, admission_min_in_flight: int = 32, log_stats: bool = True,
                 lora: dict | None = None,
                 **engine_kwargs: Any):
        # The trainer process has CUDA initialised (the learner shares it), and a forked engine process
        # cannot use CUDA then.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if attention_backend is not None:
            engine_kwargs.setdefault("attention_config", {"backend": attention_backend})
        self.adapter = _Adapter(lora) if lora is not None else None
        if self.adapter is not None:
            engine_kwargs |= self.adapter.engine_args()
        args = AsyncEngineArgs(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=replicas,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            # vLLM's offline defaults on 80 GB-class GPUs; AsyncEngineArgs would otherwise keep the server's
            # small prefill chunks, which starve a rollout of many short continuations.
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            worker_extension_cls=WORKER_EXTENSION,
            scheduling_policy="priority",  # Sampling.priority: lower first, arrival order among equals
            disable_log_stats=not log_stats,
            **engine_kwargs,
        )
        self.replicas = replicas
        self.use_request_seeds = use_request_seeds
        self.admission_interval_s = admission_interval_ms / 1000
        self.admission_min_in_flight = admission_min_in_flight
        self.engine = AsyncLLM.from_engine_args(args)
        self.asleep = False  # sleep() and wake() are idempotent: a revived engine starts awake
        self._in_flight = 0  # generate() calls not yet returned, over all replicas
        self.max_context_tokens: int | None = self.engine.model_config.max_model_len
        self._ids = itertools.count()

    def _rank(self, session: str | None) -> int | None:
        if self.replicas == 1:
            return None
        if session is None:
            return next(self._ids) % self.replicas
        return zlib.crc32(session.encode()) % self.replicas

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=sampling.seed if self.use_request_seeds else None,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop),  # only stop strings need text: rollout.py decodes the ids itself
            logprobs=0,  # the sampled token's logprob only
            flat_logprobs=True,  # a few flat lists per request, not one dict per token: less frontend CPU
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self._in_flight += 1
        try:
            if self.admission_interval_s > 0 and self._in_flight > self.admission_min_in_flight:
                await _next_wave(self.admission_interval_s)
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                                  request_id=f"{session or 'r'}-{uuid.uuid4().hex[:12]}",
                                                  data_parallel_rank=self._rank(session),
                                                  lora_request=self.adapter.request if self.adapter else None,
                                                  priority=sampling.priority):
                final = out
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":  # vLLM's engine core is gone: so is this engine
                raise EngineDied(f"vLLM's engine core died: {e}") from e
            raise
        finally:
            self._in_flight -= 1
        if final is None or not final.outputs:
            raise RuntimeError("vLLM returned no output for a request")
        c = final.outputs[0]
        if c.finish_reason not in ("stop", "length"):  # e.g. "abort": a cut-off turn must not pass for an EOS
            raise RuntimeError(f"vLLM ended a request with finish_reason {c.finish_reason!r}: expected 'stop' or 'length'")
        ids = list(c.token_ids)
        logprobs = _sampled_logprobs(c.logprobs, ids)
        stop_str = c.stop_reason if isinstance(c.stop_reason, str) else None
        return Completion(ids, logprobs, "length" if c.finish_reason == "length" else "stop", stop_str)

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Load HF-named tensors into every worker in place, bucket by bucket; returns how many."""
        return int(await load_buckets([self], named_tensors) or 0)

    async def load_weight_bucket(self, payload: bytes) -> int:
        """One bucket of HF-named tensors as safetensors bytes, loaded in every worker as it is (process.py and
        pool.py send weights so, and they cross no second encoding); returns how many tensors. Then
        `weights_loaded()` after the last bucket."""
        refuse_in_flight(self._in_flight)  # every replica's; for update_weights, before the first bucket moves
        if self.adapter is not None:
            return self.adapter.take(payload)
        loaded = await self.engine.collective_rpc("agentrl_load_weights", args=(payload,))
        return int(loaded[0])  # each worker reports the whole bucket (load_weights shards it for TP)

    async def update_weights_on_gpu(self, named_tensors: Iterable[tuple[str, Any]], size: int | None = None) -> int:
        """Load HF-named CUDA tensors on this engine's GPU (a colocated learner's) without a host copy: the
        workers map each flat bucket by its CUDA IPC handle (vllm_worker.py), then the prefix cache is
        reset. Returns how many tensors."""
        refuse_in_flight(self._in_flight)
        return await load_ipc_buckets(named_tensors, size, self.load_ipc_bucket, self.reset_prefix_cache)

    async def load_ipc_bucket(self, handle: bytes, layout: list) -> int:
        """One flat bucket of another process on this GPU (`engine.flat_bucket`, `engine.cuda_ipc_handle`),
        loaded by every worker; `weights_loaded()` after the last."""
        refuse_in_flight(self._in_flight)
        return int((await self.engine.collective_rpc("agentrl_load_ipc", args=(handle, layout)))[0])

    async def join_weight_group(self, host: str, port: int, world: int, offset: int) -> None:
        """Join the NCCL group the learner broadcasts weights in (weight_sync.WeightBroadcast, rank 0 at
        host:port): this engine's workers take ranks offset .. offset + tensor_parallel_size - 1."""
        await self.engine.collective_rpc("agentrl_join_group", args=(host, port, world, offset))

    async def receive_bucket(self, layout: list, nbytes: int) -> int:
        """Receive one flat bucket of `nbytes` broadcast in the weight group and load it in every worker;
        `weights_loaded()` after the last."""
        refuse_in_flight(self._in_flight)
        return int((await self.engine.collective_rpc("agentrl_receive_bucket", args=(layout, nbytes)))[0])

    async def weights_loaded(self) -> None:
        if self.adapter is not None:
            await self.adapter.load(self.engine)
        await self.reset_prefix_cache()  # cached KV was computed with the old weights

    async def adapters_loaded(self) -> int:
        """How many LoRA adapters vLLM holds (one at most: each push replaces the last)."""
        return len(await self.engine.list_loras())

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix. vLLM refuses (returns False) while requests run: their KV would outlive
        the reset, so that is an error, not something to go on from."""
        if await self.engine.reset_prefix_cache() is False:
            raise RuntimeError(f"vLLM kept its prefix cache because requests are still running: {BETWEEN_ROLLOUTS}")

    async def sleep(self, level: int = 1) -> None:
        """Free the GPU memory (level 1: weights kept on the host; 2: dropped); a no-op while asleep."""
        if not self.asleep:
            await self.engine.sleep(level=level)
            self.asleep = True

    async def wake(self) -> None:
        """Take the memory back; a no-op while awake (an engine started again after it died is)."""
        if self.asleep:
            await self.engine.wake_up()
            self.asleep = False

    async def aclose(self) -> None:
        self.engine.shutdown()


class _Adapter:
    """The one LoRA adapter a VLLMEngine serves beside its base. A push's buckets are collected (`take`),
    written in peft's format to the engine's own directory (in /dev/shm where there is one: memory, not disk)
    and loaded under one id with `load_inplace` (`load`): vLLM replaces the adapter it holds. Two directories
    take turns, so that the one the requests name stays whole while the next is written."""

    ID = 1

    def __init__(self, spec: dict) -> None:
        from agentrl.learner.config import LoraSpec

        self.spec = LoraSpec(**spec)
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() else Path(tempfile.gettempdir())
        _remove_orphans(parent)
        self.root = Path(tempfile.mkdtemp(prefix=f"{_ADAPTER_DIRS}{os.getpid()}-", dir=parent))
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self.tensors: dict[str, Any] = {}
        self.request: Any = None  # None until the first push: the base alone
        self.pushes = 0

    def engine_args(self) -> dict[str, Any]:
        """vLLM's LoRA settings: one adapter, on the GPU and in its host cache, of a rank vLLM offers."""
        from typing import get_args

        from vllm.config.lora import MaxLoRARanks

        ranks = [r for r in get_args(MaxLoRARanks) if r >= self.spec.rank]
        if not ranks:
            raise ValueError(f"model.lora.rank {self.spec.rank}: vLLM serves adapters of rank "
                             f"{max(get_args(MaxLoRARanks))} at most")
        return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": min(ranks)}

    def take(self, payload: bytes) -> int:
        """One bucket of a push (safetensors bytes of the learner's adapter tensors); returns how many."""
        from safetensors.torch import load

        from agentrl.learner.lora import is_adapter

        tensors = load(payload)
        other = [name for name in tensors if not is_adapter(name)]
        if other:
            raise ValueError(f"a LoRA engine takes adapter tensors only; the push sent {other[:3]}")
        self.tensors.update(tensors)
        return len(tensors)

    def write(self) -> Path:
        """The collected push in peft's format, in the directory whose turn it is."""
        from agentrl.learner.lora import write_adapter

        if not self.tensors:
            raise ValueError("a LoRA weight push brought no adapter tensors")
        path = self.root / f"v{self.pushes % 2}"
        shutil.rmtree(path, ignore_errors=True)
        write_adapter(path, self.tensors, self.spec, None)
        self.tensors = {}
        return path

    async def load(self, engine: Any) -> None:
        """The collected push as the adapter every later request uses."""
        from vllm.lora.request import LoRARequest

        path = self.write()
        await engine.add_lora(LoRARequest("agentrl", self.ID, str(path), load_inplace=True))
        self.request = LoRARequest("agentrl", self.ID, str(path))
        self.pushes += 1


_ADAPTER_DIRS = "agentrl-lora-"  # <pid>-<random>: the engine process that wrote it


def _remove_orphans(parent: Path) -> None:
    """Remove the adapter directories of engine processes that no longer run (killed before they could
    clean up: an engine that dies is started again, and each would leave its adapters in memory)."""
    for path in parent.glob(f"{_ADAPTER_DIRS}*-*"):
        pid = path.name[len(_ADAPTER_DIRS):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


async def _next_wave(interval_s: float) -> None:
    """Sleep until the next multiple of `interval_s` on the event loop's clock."""
    now = asyncio.get_running_loop().time()
    await asyncio.sleep(math.ceil(now / interval_s) * interval_s - now)


def _sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The logprob of each sampled id: from vLLM's FlatLogprobs (one entry per position when
    `logprobs=0`) or from its list of per-position dicts."""
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(ids) and list(logprobs.token_ids) == ids:
        return [float(x) for x in flat]
    return [float(position[token].logprob) for position, token in zip(logprobs, ids, strict=True)]


def vllm_processes(model: str, processes: int = 2, *, gpu_memory_utilization: float = 0.85,
                   env: dict[str, str] | None = None, start_timeout_s: float = 900.0,
                   factory: type[VLLMEngine] | None = None, **engine_kwargs: Any) -> EnginePool:
    """`processes` VLLMEngines over the same GPU(s), each in a process of its own (engine/process.py), behind one
    EnginePool (pool.py): several frontends (and engine cores) share the work that saturates one.
    `gpu_memory_utilization` is split evenly between them; they start one after another, since vLLM checks
    at start that an engine's share of the GPU's memory is free. `factory` is
    VLLMEngine or a subclass (the bench's)."""
    from agentrl.engine.pool import EnginePool
    from agentrl.engine.process import ProcessEngine

    if processes < 1:
        raise ValueError(f"processes must be at least 1, got {processes}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    kwargs = dict(engine_kwargs, model=model, gpu_memory_utilization=gpu_memory_utilization / processes)
    engines: list[ProcessEngine] = []
    try:
        for _ in range(processes):
            engines.append(ProcessEngine(factory or VLLMEngine, kwargs, env=env, start_timeout_s=start_timeout_s))
    except BaseException:
        for engine in engines:  # no event loop has used them yet: end each child through its socket
            engine._finalizer()  # noqa: SLF001
        raise
    return EnginePool(engines)
