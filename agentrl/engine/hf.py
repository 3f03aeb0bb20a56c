"""A transformers engine (CPU or GPU): concurrent requests share batched forward passes with a KV cache.

Requests from many trajectories (rollout.py runs one asyncio task per trajectory) queue up; a worker
takes whatever is waiting, up to `max_batch` (lowest `Sampling.priority` first, then in arrival order), and
decodes it as one batch: left-padded prefill, then one
token per step for every unfinished row, rows leaving the KV cache as they finish. Requests arriving
meanwhile form the next batch. The model runs in a thread so the event loop keeps serving tools.

Sampling is seeded per request (`Sampling.seed`, else the engine's seed and a request counter), so a run
is reproducible. Stops: EOS ids, stop strings (checked on the decoded ids; the token completing one is
kept whole, as vLLM does), max_tokens. This engine is the CPU test double of vllm.py and the
reference the vLLM engine is checked against on the GPU machine.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.engine import Completion, Sampling, completed_stop


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling
    generator: torch.Generator
    future: asyncio.Future
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    stop_str: str | None = None


class HFEngine:
    def __init__(self, model: Any, tokenizer: Any, *, max_batch: int = 64, seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.seed = seed
        self.device = next(model.parameters()).device
        self.max_context_tokens: int | None = getattr(model.config, "max_position_embeddings", None)
        eos = getattr(model.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.eos_ids), 0)
        # transformers 5.2x renamed `past_key_values` to `cache`; older 5.x (the GPU image's) has only the former.
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._queue: list[_Request] = []
        self._worker: asyncio.Task | None = None
        self._counter = itertools.count()
        self.stats = {"batches": 0, "forward_steps": 0, "requests": 0}

    @classmethod
    def from_pretrained(cls, path: str, *, device: str = "cpu", max_batch: int = 64, seed: int = 0,
                        dtype: str = "auto") -> HFEngine:
        """An engine over the model and tokenizer saved in `path` (what engine/process.py's child makes), in
        `dtype` (auto: the checkpoint's; float32 to match a float32 learner's numerics)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), max_batch=max_batch, seed=seed)

    async def generate(self, prompt_ids: list[int], sampling: Sampling, *, session: str | None = None) -> Completion:
        if not prompt_ids:
            raise ValueError("generate() needs at least one prompt token")
        generator = torch.Generator().manual_seed(
            sampling.seed if sampling.seed is not None else self.seed * 1_000_003 + next(self._counter)
        )
        request = _Request(list(prompt_ids), sampling, generator, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await request.future

    async def _serve(self) -> None:
        while self._queue:
            self._queue.sort(key=lambda r: r.sampling.priority)  # stable: arrival order among equals
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            try:
                await asyncio.to_thread(self._decode_batch, batch)
            except Exception as e:  # a failed forward fails its requests, not the engine
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r in batch:
                if not r.future.done():
                    r.future.set_result(
                        Completion(r.out_ids, r.logprobs, "length" if r.finish == "length" else "stop", r.stop_str)
                    )

    @torch.no_grad()
    def _decode_batch(self, batch: list[_Request]) -> None:
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        for r in batch:
            if r.sampling.max_tokens <= 0:
                r.finish = "length"
        active = [r for r in batch if r.finish is None]
        if not active:
            return
        width = max(len(r.prompt_ids) for r in active)
        ids_BT = torch.full((len(active), width), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(active), width), dtype=torch.long)
        for i, r in enumerate(active):
            ids_BT[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask_BT[i, width - len(r.prompt_ids) :] = 1
        ids_BT, mask_BT = ids_BT.to(self.device), mask_BT.to(self.device)
        positions_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache()
        while active:
            out = self.model(  # logits of the last position only: the prefill's other rows would be discarded
                input_ids=ids_BT, attention_mask=mask_BT, position_ids=positions_BT, use_cache=True, logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            self.stats["forward_steps"] += 1
            cache = out[self._cache_kw]
            logits_BV = out.logits[:, -1, :].float().cpu()
            tokens = [self._sample(r, logits_BV[i]) for i, r in enumerate(active)]
            keep = [i for i, r in enumerate(active) if self._append(r, *tokens[i]) is None]
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                mask_BT, positions_BT = mask_BT[index], positions_BT[index]
                active = [active[i] for i in keep]
                tokens = [tokens[i] for i in keep]
            ids_BT = torch.tensor([[t] for t, _ in tokens], device=self.device)
            mask_BT = torch.cat([mask_BT, torch.ones_like(ids_BT)], dim=1)
            positions_BT = positions_BT[:, -1:] + 1

    def _sample(self, r: _Request, logits_V: torch.Tensor) -> tuple[int, float]:
        s = r.sampling
        if s.temperature <= 0:
            logprobs_V = torch.log_softmax(logits_V, dim=-1)
            token = int(torch.argmax(logits_V))
            return token, float(logprobs_V[token])
        logprobs_V = torch.log_softmax(logits_V / s.temperature, dim=-1)
        probs_V = logprobs_V.exp()
        if s.top_k > 0 and s.top_k < probs_V.numel():
            kth = torch.topk(probs_V, s.top_k).values[-1]
            probs_V = torch.where(probs_V >= kth, probs_V, torch.zeros_like(probs_V))
        if s.top_p < 1.0:
            sorted_V, order_V = torch.sort(probs_V, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
            outside_V = (sorted_V.cumsum(0) - sorted_V) >= s.top_p * sorted_V.sum()
            sorted_V[outside_V] = 0.0
            probs_V = torch.zeros_like(probs_V).scatter(0, order_V, sorted_V)
        kept = probs_V.sum()
        token = int(torch.multinomial(probs_V / kept, 1, generator=r.generator))
        # the logprob under the distribution sampled from: renormalised over what top-k / top-p kept
        return token, float(logprobs_V[token] - torch.log(kept))

    def _append(self, r: _Request, token: int, logprob: float) -> str | None:
        """Record a sampled token; return why the request finished, or None to go on."""
        r.out_ids.append(token)
        r.logprobs.append(logprob)
        if token in self.eos_ids:
            r.finish = "eos"
        elif (stop := completed_stop(self.tokenizer, r.out_ids, r.sampling.stop)) is not None:
            r.stop_str, r.finish = stop, "stop"
        if r.finish is None and len(r.out_ids) >= r.sampling.max_tokens:
            r.finish = "length"
        return r.finish

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"update_weights: the model has no parameter {name!r}")
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    async def aclose(self) -> None:
        if self._worker is not None:
            await asyncio.gather(self._worker, return_exceptions=True)
