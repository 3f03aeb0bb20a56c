"""Weights into an engine: the forms they travel in, and what an engine declares it can receive.

The learner's side (which transport, when) is weight_sync.py; this is the engines' side, shared by every
engine and by the learner's sender:
- buckets: HF-named tensors grouped to about BUCKET_BYTES (`bucket_by_bytes`), each encoded once as
  safetensors bytes (`encode_bucket`) for engines in other processes or on other machines;
- flat GPU buckets: one uint8 buffer per bucket on the GPU (`flat_bucket`), mapped by CUDA IPC
  (`cuda_ipc_handle`) or sent by one NCCL broadcast.

Every engine takes tensors (`Engine.update_weights`). The protocols below say what else it may offer;
an engine is checked against them, never probed for a method name: `BucketReceiver` (safetensors bytes:
VLLMEngine, ProcessEngine), `GpuReceiver` (CUDA IPC and NCCL: VLLMEngine, and ProcessEngine over one) and
`Sleeper` (frees its GPU memory while the learner trains). `load_bucket` is the one place where bytes
become tensors for an engine that takes only tensors.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from agentrl.engine import maybe_await, on_each, raise_first


@runtime_checkable
class BucketReceiver(Protocol):
    async def load_weight_bucket(self, payload: bytes) -> int | None:
        """One `encode_bucket` payload, loaded as it is; returns how many tensors (None: not counted)."""
        ...

    async def weights_loaded(self) -> None:
        """After the last bucket of an update (e.g. vLLM drops its prefix cache, computed with the old weights)."""
        ...


@runtime_checkable
class GpuReceiver(Protocol):
    async def update_weights_on_gpu(self, named_tensors: Iterable[tuple[str, Any]], size: int | None = None) -> int:
        """HF-named CUDA tensors of this process, by CUDA IPC (the engine is on the same GPU)."""
        ...

    async def load_ipc_bucket(self, handle: bytes, layout: list) -> int:
        """One flat bucket of another process on this GPU; `weights_loaded()` after the last."""
        ...

    async def join_weight_group(self, host: str, port: int, world: int, offset: int) -> None:
        """Join the learner's NCCL broadcast group (weight_sync.WeightBroadcast, rank 0 at host:port)."""
        ...

    async def receive_bucket(self, layout: list, nbytes: int) -> int:
        """Receive one flat bucket broadcast in that group; `weights_loaded()` after the last."""
        ...

    async def weights_loaded(self) -> None: ...


@runtime_checkable
class Sleeper(Protocol):
    async def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory (vLLM's sleep levels) while the learner trains."""
        ...

    async def wake(self) -> None: ...


async def load_bucket(engine: Any, payload: bytes) -> int | None:
    """One `encode_bucket` payload into `engine`: as it is where the engine takes bytes, else its tensors
    through `update_weights`. Returns what the engine reports loaded (None: it reports nothing)."""
    if isinstance(engine, BucketReceiver):
        return await engine.load_weight_bucket(payload)
    from safetensors.torch import load

    return await maybe_await(engine.update_weights(list(load(payload).items())))


async def weights_loaded(engine: Any) -> None:
    """The end of an update, for an engine that wants to know (a `BucketReceiver`)."""
    if isinstance(engine, BucketReceiver):
        await maybe_await(engine.weights_loaded())


# Weights travel to an engine in buckets of about this many bytes: bounded host memory per transfer.
BUCKET_BYTES = 256 << 20
# On the GPU (CUDA IPC, NCCL) a bucket is one flat buffer: larger, so that there are few of them.
GPU_BUCKET_BYTES = 1 << 30


def bucket_by_bytes(named_tensors: Iterable[tuple[str, Any]], size: int | None = None) -> Iterator[list[tuple[str, Any]]]:
    """(name, tensor) pairs grouped into lists of about `size` bytes (BUCKET_BYTES by default; a tensor
    larger than that is alone): the unit in which weights travel from the learner to an engine."""
    size_limit = BUCKET_BYTES if size is None else size
    bucket: list[tuple[str, Any]] = []
    filled = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and filled + nbytes > size_limit:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += nbytes
    if bucket:
        yield bucket


def encode_bucket(bucket: Iterable[tuple[str, Any]]) -> bytes:
    """A bucket of HF-named tensors as safetensors bytes: one encoding serves every process and worker
    (a `BucketReceiver` loads it as it is)."""
    from safetensors.torch import save

    return save({name: _alone_on_cpu(t) for name, t in bucket})


def flat_bucket(bucket: Sequence[tuple[str, Any]]) -> tuple[Any, list[tuple[str, str, list[int], int]]]:
    """A bucket of HF-named tensors (on one GPU) packed into one flat uint8 buffer on that GPU, and its layout:
    (name, dtype name, shape, byte offset) per tensor, each at a 256-byte aligned offset. The form in which
    weights cross processes on the GPU: one CUDA IPC handle (a colocated engine) or one NCCL broadcast (a
    split one) per bucket, not one per parameter; the receiver takes views of it (vllm_worker.py)."""
    import torch

    layout, offset = [], 0
    for name, t in bucket:
        layout.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // 256) * 256
    flat = torch.empty(offset, dtype=torch.uint8, device=bucket[0][1].device)
    for (_, t), (_, _, _, start) in zip(bucket, layout, strict=True):
        flat[start : start + t.numel() * t.element_size()].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    torch.cuda.current_stream(flat.device).synchronize()  # the bucket is whole before another process reads it
    return flat, layout


def flat_buckets(named_tensors: Iterable[tuple[str, Any]], size: int | None = None) -> Iterator[tuple[Any, list]]:
    """`flat_bucket` of each bucket of HF-named GPU tensors (`GPU_BUCKET_BYTES` by default), one at a time: the
    caller drops each buffer (`del`) once its receivers are done with it, before asking for the next."""
    for bucket in bucket_by_bytes(named_tensors, size or GPU_BUCKET_BYTES):
        yield flat_bucket(bucket)


def cuda_ipc_handle(flat: Any) -> bytes:
    """What another process on the same GPU needs to map `flat` (torch's `rebuild_cuda_tensor` arguments,
    pickled). `flat` must outlive the receiver's use of it."""
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(flat)[1])


async def load_ipc_buckets(named_tensors: Iterable[tuple[str, Any]], size: int | None,
                           load: Callable[[bytes, list], Awaitable[int]], loaded: Callable[[], Awaitable[Any]]) -> int:
    """HF-named CUDA tensors to an engine on the same GPU, never through the host: each bucket packed into
    one flat buffer (`flat_buckets`) whose CUDA IPC handle `load(handle, layout)` hands to the receivers; the
    buffer is dropped once they return, then `loaded()` after the last. Returns how many tensors."""
    import torch

    total = 0
    for flat, layout in flat_buckets(named_tensors, size):
        total += int(await load(cuda_ipc_handle(flat), layout))
        del flat
    torch.cuda.ipc_collect()  # the receivers' mappings are gone: free the buffers' memory now
    await loaded()
    return total


async def load_buckets(engines: Sequence[Any], named_tensors: Iterable[tuple[str, Any]]) -> int | None:
    """Send HF-named tensors to every engine, bucket by bucket, all engines at once: those that take buckets
    (`BucketReceiver`s) get the bucket encoded once, then `weights_loaded()` after the last; the others get it
    through `update_weights`. Returns how many tensors the first engine reports loaded (None where it reports
    nothing). If an engine fails a bucket, the others finish that bucket, no further bucket moves,
    `weights_loaded()` is not called, and the first error is raised: the engines then hold a mix of old and
    new weights until an update succeeds."""
    by_bucket = [isinstance(e, BucketReceiver) for e in engines]
    total: int | None = None
    for bucket in bucket_by_bytes(named_tensors):
        payload = encode_bucket(bucket) if any(by_bucket) else None
        counts = raise_first(await on_each(
            engines, lambda e, b=bucket, p=payload: e.load_weight_bucket(p) if isinstance(e, BucketReceiver) else e.update_weights(b)))
        if counts[0] is not None:
            total = (total or 0) + counts[0]
    raise_first(await on_each([e for e, b in zip(engines, by_bucket, strict=True) if b], lambda e: e.weights_loaded()))
    return total


def _alone_on_cpu(tensor: Any) -> Any:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses views that share storage)."""
    t = tensor.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
