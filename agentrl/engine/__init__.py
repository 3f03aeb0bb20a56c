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
`update_weights` takes the learner's tensors; weights.py declares what else an engine may offer to receive
them (safetensors buckets, CUDA IPC, an NCCL broadcast) and to free its memory (`Sleeper`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Iterable, Sequence
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


class EngineDied(RuntimeError):
    """The engine can answer nothing more (vLLM's engine core died). Raised by the engine; in a process of
    its own (engine/process.py) that process then exits, so the trainer starts it again as after a crash."""


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
