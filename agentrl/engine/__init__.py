"""Engines: the one narrow interface between the rollout (rollout.py) and a model that generates.

`Engine.generate(prompt_ids, sampling)` continues a token sequence and returns a `Completion`: exactly the
ids sampled, each with its logprob, and why generation stopped. Stop strings stay in the output (the
token that completes a stop string is returned whole, even when the string ends inside it), so the ids
the learner trains on are the ids sampled.

Logprobs are those of the distribution sampled from: log_softmax(logits / temperature), renormalised over
the tokens top-k / top-p keep when they are on (what vLLM's `processed_logprobs` give; with both off, the
RL default, nothing is cut), with temperature 1 for greedy decoding. They are the behaviour policy's, as
the learner's importance-sampling correction needs.

Implementations: hf.py (transformers; CPU and GPU; the test double and small runs) and vllm.py (vLLM
AsyncLLM; GPU); process.py runs any engine in a process of its own, pool.py puts several behind one.
`update_weights`, `sleep` and `wake` are there for the learner's weight updates and for training on the
same GPUs as generation.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, runtime_checkable


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()
    seed: int | None = None  # fixes this request's draws; None: the engine's own stream
    # lower first: an engine with requests waiting serves the lowest priority first, in arrival order
    # among equals (the asynchronous trainer's lookahead groups then take only capacity the current step leaves)
    priority: int = 0

    def with_(self, **changes: object) -> Sampling:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    stop_str: str | None = None  # the stop string that ended generation; None for EOS or length
    # runs of (tokens, policy version that sampled them), in order (engine/versioned.py); None: not tracked
    versions: list[tuple[int, int]] | None = None


# What an engine says when asked for new weights while its requests still run.
BETWEEN_ROLLOUTS = "update weights between rollouts, after every request has finished"


@runtime_checkable
class Engine(Protocol):
    # The most tokens (prompt and output) one sequence may hold, or None: the rollout never asks for more,
    # so a trajectory that reaches it ends as context_limit instead of failing the request.
    max_context_tokens: int | None

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        """Continue `prompt_ids`. `session` names the trajectory, so that an engine with several replicas
        sends all its turns to the same one (its prefix cache holds the earlier turns)."""
        ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, object]]) -> None:
        """Replace weights in place with Hugging Face-named tensors (the learner's, after a step)."""
        ...

    async def aclose(self) -> None: ...


def stop_completed_in_last_token(text: str, text_before_last: str, stops: Iterable[str]) -> str | None:
    """The stop string that the last token completed, if any. `text` is the decoded output so far and
    `text_before_last` the same without its last token: a stop string counts only when its end lies in
    the last token, because it would have stopped generation earlier otherwise. Where the two texts part
    (not simply the shorter one's length: a character cut between tokens decodes as U+FFFD there) is where
    the last token's text begins."""
    boundary = len(os.path.commonprefix([text, text_before_last]))
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        start = text.find(s, max(0, boundary - len(s) + 1))
        if start >= 0 and (best is None or start < best[0]):
            best = (start, s)
    return best[1] if best else None


def completed_stop(tokenizer: object, ids: Sequence[int], stops: Sequence[str]) -> str | None:
    """The stop string that the last of `ids` completed, if any. Decodes only a tail window (a stop string
    spans at most one token per character), so the check costs the same at token 3000 as at token 3."""
    if not stops or not ids:
        return None
    window = list(ids[-(max(map(len, stops)) + 8) :])
    decode = tokenizer.decode  # type: ignore[attr-defined]
    return stop_completed_in_last_token(decode(window), decode(window[:-1]), stops)


# Weights travel to an engine in buckets of about this many bytes: bounded host memory per transfer.
BUCKET_BYTES = 256 << 20
# On the GPU (CUDA IPC, NCCL) a bucket is one flat buffer: larger, so that there are few of them.
GPU_BUCKET_BYTES = 1 << 30


def bucket_by_bytes(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int | None = None) -> Iterator[list[tuple[str, Any]]]:
    """(name, tensor) pairs grouped into lists of about `bucket_bytes` (BUCKET_BYTES by default; a tensor larger
    than that is alone): the unit in which weights travel from the learner to an engine."""
    bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_bytes(bucket: Iterable[tuple[str, Any]]) -> bytes:
    """A bucket of HF-named tensors as safetensors bytes. Engines that take weights so have
    `load_weight_bucket(payload) -> int | None` (the tensors it loaded) and `weights_loaded()`, called once
    after the last bucket (vllm.py, process.py): one encoding then serves every process and worker."""
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


def flat_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int | None = None) -> Iterator[tuple[Any, list]]:
    """`flat_bucket` of each bucket of HF-named GPU tensors (`GPU_BUCKET_BYTES` by default), one at a time: the
    caller drops each buffer (`del`) once its receivers are done with it, before asking for the next."""
    for bucket in bucket_by_bytes(named_tensors, bucket_bytes or GPU_BUCKET_BYTES):
        yield flat_bucket(bucket)


def cuda_ipc_handle(flat: Any) -> bytes:
    """What another process on the same GPU needs to map `flat` (torch's `rebuild_cuda_tensor` arguments,
    pickled). `flat` must outlive the receiver's use of it."""
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(flat)[1])


async def load_ipc_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int | None,
                           load: Callable[[bytes, list], Awaitable[int]], loaded: Callable[[], Awaitable[Any]]) -> int:
    """HF-named CUDA tensors to an engine on the same GPU, never through the host: each bucket packed into
    one flat buffer (`flat_buckets`) whose CUDA IPC handle `load(handle, layout)` hands to the receivers; the
    buffer is dropped once they return, then `loaded()` after the last. Returns how many tensors."""
    import torch

    total = 0
    for flat, layout in flat_buckets(named_tensors, bucket_bytes):
        total += int(await load(cuda_ipc_handle(flat), layout))
        del flat
    torch.cuda.ipc_collect()  # the receivers' mappings are gone: free the buffers' memory now
    await loaded()
    return total


def takes_buckets(engine: object) -> bool:
    return callable(getattr(engine, "load_weight_bucket", None)) and callable(getattr(engine, "weights_loaded", None))


async def load_buckets(engines: Sequence[Any], named_tensors: Iterable[tuple[str, Any]]) -> int | None:
    """Send HF-named tensors to every engine, bucket by bucket, all engines at once: those that take buckets
    (`takes_buckets`) get the bucket encoded once, then `weights_loaded()` after the last; the others get it
    through `update_weights`. Returns how many tensors the first engine reports loaded (None where it reports
    nothing). If an engine fails a bucket, the others finish that bucket, no further bucket moves,
    `weights_loaded()` is not called, and the first error is raised: the engines then hold a mix of old and
    new weights until an update succeeds."""
    by_bucket = [takes_buckets(e) for e in engines]
    total: int | None = None
    for bucket in bucket_by_bytes(named_tensors):
        payload = bucket_bytes(bucket) if any(by_bucket) else None
        counts = raise_first(await on_each(
            engines, lambda e, b=bucket, p=payload: e.load_weight_bucket(p) if takes_buckets(e) else e.update_weights(b)))
        if counts[0] is not None:
            total = (total or 0) + counts[0]
    raise_first(await on_each([e for e, b in zip(engines, by_bucket, strict=True) if b], lambda e: e.weights_loaded()))
    return total


def refuse_in_flight(requests: int) -> None:
    """An engine's answer to a weight update while `requests` of its requests still run."""
    if requests:
        raise RuntimeError(f"{requests} requests are still generating: {BETWEEN_ROLLOUTS}")


async def maybe_await(value: Any) -> Any:
    """`value`, awaited first where it is awaitable (an engine's methods may be plain or coroutines)."""
    return await value if inspect.isawaitable(value) else value


async def on_each(engines: Sequence[Any], call: Any) -> list[Any]:
    """`call(engine)` for every engine at once, awaited where it returns an awaitable: each result, or the
    exception it raised, in engine order. One engine's failure (even raised before any await) stops no other."""
    async def one(engine: Any) -> Any:
        return await maybe_await(call(engine))

    return await asyncio.gather(*(one(e) for e in engines), return_exceptions=True)


def raise_first(results: Sequence[Any]) -> list[Any]:
    """`results` (of `on_each`) if none is an exception; else raise one, the others noted on it. An error
    (Exception) comes before anything else, and an engine's own cancellation is raised as a RuntimeError:
    the caller was not cancelled (asyncio would have raised that to it directly)."""
    raised = sorted((r for r in results if isinstance(r, BaseException)), key=lambda r: not isinstance(r, Exception))
    if not raised:  # (sorted is stable: errors first, in engine order)
        return list(results)
    errors = [RuntimeError("a call was cancelled inside an engine") if isinstance(r, asyncio.CancelledError) else r
              for r in raised]
    for other in errors[1:]:
        if other is not errors[0]:
            errors[0].add_note(f"another engine failed too: {type(other).__name__}: {other}")
    raise errors[0]


def _alone_on_cpu(tensor: Any) -> Any:
    """A contiguous CPU tensor owning exactly its bytes (safetensors refuses views that share storage)."""
    t = tensor.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()
