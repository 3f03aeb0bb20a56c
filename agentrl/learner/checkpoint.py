"""Checkpoints, HF export and full-tensor iteration of a sharded module (worker.py's state methods).

Checkpoint layout (a directory; written to `<dir>.tmp`, marked COMPLETE once every rank has finished, then
swapped in: the previous `<dir>` moves to `<dir>.old`, `<dir>.tmp` becomes `<dir>`, `<dir>.old` goes. A
save killed anywhere leaves a complete checkpoint that the next save or load finds: `_recover`):

    <dir>/model_optim/   torch.distributed.checkpoint: {"model": sharded weights, "optim": AdamW moments},
                         one .distcp file per rank plus .metadata; loadable on another number of ranks
    <dir>/learner.pt     rank 0: optimizer step counters, LR-schedule state, the caller's `extra`
                         (e.g. the trainer's data position); plain data only
    <dir>/rng_rank<r>.pt each rank's CPU, CUDA and Python RNG states

`export_hf` writes `save_pretrained` output (config, safetensors, generation config) that transformers and
vLLM load, a LoRA adapter merged in and also written on its own (`adapter/`, lora.py); `iter_full_state` yields one full tensor at a time for weight sync, so the whole model is never
gathered at once.
"""

from __future__ import annotations

import copy
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from agentrl.learner import lora
from agentrl.learner.fsdp import DistContext, clean_name


def iter_full_state(module: nn.Module, prefix: str, dtype: torch.dtype,
                    trained_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for each parameter under `prefix` (`trained_only`: those that train), cast to
    `dtype` before gathering (half the traffic in bf16). Tied parameters appear once, under their first
    name. Collective."""
    for name, param in module.named_parameters():
        name = clean_name(name)
        if not name.startswith(prefix) or (trained_only and not param.requires_grad):
            continue
        tensor = param.detach().to(dtype)
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name[len(prefix):], tensor


def save(
    path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, state: dict[str, Any], ctx: DistContext,
    trained_only: bool = False,
) -> None:
    """The checkpoint at `path` (the layout above); `trained_only`: the weights that train (a LoRA
    adapter), not the frozen ones, which the model's own checkpoint holds. Collective."""
    final = Path(path)
    tmp, _ = _aside(final)
    if ctx.rank == 0:
        _recover(final)  # a newer complete checkpoint in .tmp must not be deleted as a leftover
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    options = StateDictOptions(ignore_frozen_params=trained_only)
    payload: dict[str, Any] = {"model": _model_state(module, options, trained_only)}
    # Before its first step an optimizer has no state, and reading it (get_optimizer_state_dict) would
    # create some by stepping with zero gradients: Adam's step count would then be one ahead.
    if optimizer is not None and optimizer.state:
        payload["optim"] = get_optimizer_state_dict(module, optimizer, options=options)
    dcp.save(payload, checkpoint_id=str(tmp / "model_optim"))
    torch.save(_rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    if ctx.rank == 0:
        torch.save(state | {"scheduler": scheduler.state_dict() if scheduler else None}, tmp / "learner.pt")
    dist.barrier()
    if ctx.rank == 0:
        (tmp / COMPLETE).touch()
        _swap_in(final)
    dist.barrier()


COMPLETE = "COMPLETE"  # in <dir>.tmp: every rank finished writing it


def _model_state(module: nn.Module, options: StateDictOptions, trained_only: bool) -> dict[str, Any]:
    """The module's state dict; `trained_only`: the parameters that train and nothing else (a frozen tied
    embedding would otherwise come back under its second name)."""
    state = get_model_state_dict(module, options=options)
    if trained_only:
        trained = {clean_name(n) for n, p in module.named_parameters() if p.requires_grad}
        state = {k: v for k, v in state.items() if clean_name(k) in trained}
    return state


def _aside(final: Path) -> tuple[Path, Path]:
    """Where a new `final` is written (`<dir>.tmp`) and where the previous one waits while it is swapped
    in (`<dir>.old`)."""
    return final.with_name(final.name + ".tmp"), final.with_name(final.name + ".old")


def _swap_in(final: Path) -> None:
    """`<dir>.tmp`, complete, becomes `final`; the previous `final` goes by way of `<dir>.old`, so that at
    every moment one complete directory exists under one of the three names."""
    tmp, old = _aside(final)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _recover(final: Path) -> None:
    """Finish a save that was killed while swapping directories (rank 0): the newest complete checkpoint
    becomes `final` again; a leftover `.old` goes."""
    tmp, old = _aside(final)
    if not final.exists():
        if (tmp / COMPLETE).exists():
            tmp.rename(final)
        elif old.exists():
            old.rename(final)
    if final.exists() and old.exists():
        shutil.rmtree(old)


def load(
    path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, ctx: DistContext, trained_only: bool = False,
) -> dict[str, Any]:
    root = Path(path)
    if ctx.rank == 0:
        _recover(root)
    dist.barrier()
    if not (root / "learner.pt").exists():
        raise FileNotFoundError(f"{root}: not a learner checkpoint (no learner.pt)")
    options = StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)
    payload: dict[str, Any] = {"model": _model_state(module, options, trained_only)}
    saved = dcp.FileSystemReader(str(root / "model_optim")).read_metadata().state_dict_metadata
    with_optim = optimizer is not None and any(key.startswith("optim.") for key in saved)  # saved after a step
    if with_optim:
        payload["optim"] = get_optimizer_state_dict(module, optimizer, options=options)
    missing = [k for k in payload["model"] if f"model.{k}" not in saved]
    if missing:  # a checkpoint of full weights into an adapted model, or the other way round
        expected = "a LoRA adapter" if trained_only else "full weights"
        raise ValueError(f"{root}: its weights do not fit this model ({expected} expected; was model.lora "
                         f"changed?): it has no {missing[0]!r} ({len(missing)} missing)")
    dcp.load(payload, checkpoint_id=str(root / "model_optim"))
    set_model_state_dict(module, payload["model"], options=options)
    if with_optim:
        set_optimizer_state_dict(module, optimizer, payload["optim"], options=options)
    state = torch.load(root / "learner.pt", weights_only=True)
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = root / f"rng_rank{ctx.rank}.pt"
    if rng.exists():  # absent when resuming on more ranks than saved: those ranks keep their seeds
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def export_hf(path: str | Path, module: nn.Module, hf_model: nn.Module, prefix: str, dtype: torch.dtype,
              ctx: DistContext, tokenizer: Any = None, adapter: Any = None, base: str | None = None) -> None:
    """`save_pretrained` of the HF model inside `module` with gathered weights in `dtype` (rank 0 writes),
    with `tokenizer`'s files beside it when one is given. An `adapter` (a LoraSpec: the model is adapted) is
    merged into the weights written, and written itself under `adapter/` in peft's format, naming `base`."""
    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        # a tied output embedding is the input embedding under a second name: write it once
        tied = ({clean_name(n) for n, _ in hf_model.named_parameters(remove_duplicate=False)}
                - {clean_name(n) for n, _ in hf_model.named_parameters()})
        state = {}
        for name, tensor in full.items():
            name = clean_name(name)
            if name.startswith(prefix) and name[len(prefix):] not in tied:
                state[name[len(prefix):]] = tensor
        merged = lora.merged(state, adapter) if adapter is not None else state
        # written aside, then renamed into place: a killed export leaves no half-written model at `path`
        final = Path(path)
        tmp, old = _aside(final)
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover)
        hf_model.save_pretrained(str(tmp), state_dict={n: t.to(dtype) for n, t in merged.items()})
        config = copy.deepcopy(hf_model.config)
        config.dtype = dtype  # save_pretrained recorded the float32 master weights' dtype
        config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if adapter is not None:
            lora.write_adapter(tmp / "adapter", state, adapter, base)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / "adapter"))
        _swap_in(final)
    dist.barrier()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
