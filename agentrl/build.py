"""What a run is made of, built in one place: the tokenizer, the policy's starting weights, the rollout
engines. The one-process trainer, the Ray actors (placement.py), `agentrl sft` and `agentrl eval` all build
theirs here, so an engine setting means the same thing wherever the engine runs.

    run_tokenizer(config)            model.tokenizer, else the checkpoint's own
    build_lm(config)                 the checkpoint, or a seeded random init of model.config (float32)
    engine_model_dir(config, ...)    what a vLLM engine loads at start: model.path, or that init on disk
    build_engine(config, ...)        the run's engine: transformers (HFEngine) or vLLM, in this process or
                                     in a child process (engine/process.py)
    checkpoint_engine(kind, path)    an engine over a finished checkpoint (`agentrl eval`)
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.config import ConfigError
from agentrl.task import load_tokenizer

if TYPE_CHECKING:
    from agentrl.run_config import RunConfig


def run_tokenizer(config: Any) -> Any:
    """The run's tokenizer (`config` is a RunConfig or an SFTConfig: both have `model`)."""
    return load_tokenizer(config.model.tokenizer or config.model.path or "", option="model.tokenizer")


def build_lm(config: Any) -> torch.nn.Module:
    """The policy's starting weights in float32: the checkpoint, or a seeded random init of the config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = config.model
    if m.path is not None:
        return AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.float32)
    kwargs = dict(m.config or {})
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(m.init_seed)
    return AutoModelForCausalLM.from_config(hf_config).float()


def engine_model_dir(config: RunConfig, run_root: Path, tokenizer: Any, lm: torch.nn.Module | None = None) -> str:
    """What a vLLM engine loads at start (it loads weights from files): model.path, or the random init
    written to <run_root>/init once (`lm`, or built here), whole or not at all."""
    if config.model.path is not None:
        return config.model.path
    path = run_root / "init"
    if not (path / "config.json").exists():
        tmp = path.with_name("init.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (lm if lm is not None else build_lm(config).to(torch.bfloat16)).save_pretrained(tmp)  # engines load bf16
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    return str(path)


def engine_device(device: str) -> str:
    """engine.device with `auto` resolved: CUDA where there is a GPU."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def build_engine(config: RunConfig, *, seed: int, model_dir: str | None = None, lm: torch.nn.Module | None = None,
                 tokenizer: Any = None, own_process: bool | None = None, **vllm_overrides: Any) -> Any:
    """The run's engine (engine.* settings), sampling with `seed`. vLLM: over the weights in `model_dir`,
    in a child process with `own_process` (default: engine.own_process), serving the run's LoRA adapter beside
    those weights where it trains one. Transformers: a copy of `lm` (or the run's starting weights) on
    engine.device, with the LoRA adapter injected likewise. The learner's first push replaces the weights
    (the adapter) either way."""
    e = config.engine
    if e.kind == "vllm":
        from agentrl.engine.vllm import VLLMEngine

        kwargs = dict(model=model_dir, gpu_memory_utilization=e.gpu_memory_utilization,
                      max_model_len=e.max_model_len, enable_sleep_mode=e.sleep_level > 0,
                      enforce_eager=e.enforce_eager, tensor_parallel_size=e.tensor_parallel_size, seed=seed,
                      use_request_seeds=e.request_seeds,
                      lora=config.model.lora.model_dump() if config.model.lora else None) | vllm_overrides
        if e.own_process if own_process is None else own_process:
            from agentrl.engine.process import ProcessEngine

            return ProcessEngine(VLLMEngine, kwargs)
        return VLLMEngine(**kwargs)
    from agentrl.engine.hf import HFEngine

    model = lm if lm is not None else build_lm(config)
    if config.model.lora is not None:  # base + adapter, as the learner holds them; pushes replace the adapter
        from agentrl.learner.lora import add_lora, round_base

        model = add_lora(model, config.model.lora)
        learner = config.learner
        on_gpu = learner.device == "cuda" or (learner.device == "auto" and torch.cuda.is_available())
        if learner.precision == "bf16" or (learner.precision == "auto" and on_gpu):
            round_base(model, torch.bfloat16)  # the learner keeps its frozen base in bf16; no push sends it
    return HFEngine(model.to(engine_device(e.device)), tokenizer if tokenizer is not None else run_tokenizer(config),
                    max_batch=e.max_batch, seed=seed)


def checkpoint_engine(kind: str, model: str, seed: int) -> Any:
    """An engine over the checkpoint `model` for evaluation: `kind` hf, vllm or auto (vLLM where a GPU and
    vLLM are). vLLM draws each request from its own seed, so a sample does not depend on its batch. `model`
    may be a LoRA adapter (a run's `export/adapter`): it is merged into the base it names, first."""
    from agentrl.learner import lora

    if kind == "auto":
        kind = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    if kind not in ("hf", "vllm"):
        raise ConfigError(f"--engine {kind!r}: expected auto, hf or vllm")
    adapter = lora.is_adapter_dir(model)
    if kind == "vllm":
        from agentrl.engine.vllm import VLLMEngine

        if not adapter:
            return VLLMEngine(model, seed=seed, use_request_seeds=True)
        merged = tempfile.mkdtemp(prefix="agentrl-merged-")  # vLLM loads from files, in its engine core
        atexit.register(shutil.rmtree, merged, ignore_errors=True)
        lm, _ = lora.load_merged(model)
        lm.save_pretrained(merged)
        load_tokenizer(model).save_pretrained(merged)
        return VLLMEngine(merged, seed=seed, use_request_seeds=True)
    from agentrl.engine.hf import HFEngine

    if adapter:
        lm, _ = lora.load_merged(model)
        return HFEngine(lm.to(engine_device("auto")), load_tokenizer(model), seed=seed)
    return HFEngine.from_pretrained(model, device=engine_device("auto"), seed=seed)
