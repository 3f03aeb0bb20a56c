"""LoRA: train low-rank adapters on a frozen base instead of the full weights.

    model:
      lora: {rank: 32, alpha: 64, dropout: 0.0, target_modules: all-linear}

`add_lora` injects peft's LoRA layers into the HF model in place (`peft.inject_adapter_in_model`: no
PeftModel wrapper, so the model keeps its structure and forward; an adapted Linear `q_proj` becomes a layer
holding `q_proj.base_layer` and the adapter's `q_proj.lora_A.default` / `lora_B.default`) and freezes
every other parameter. What follows from the frozen base, in the learner (worker.py) and the engines:

- the optimizer holds the adapter only, and the frozen base is kept in the compute dtype (no float32 master
  copy, no gradients, no moments: the memory of full fine-tuning's 16 bytes a parameter goes);
- the reference policy is the same model with the adapter switched off (`adapter_off`): no second copy of
  the weights (reference.py `BaseReference`);
- a weight push sends the adapter's tensors only, and the engine holds base + adapter of the same shape
  (build.py injects it into a transformers engine; a vLLM engine serves it through vLLM's LoRA support,
  engine/vllm.py), each push replacing the one adapter it holds;
- a checkpoint holds the adapter and its optimizer state; the base comes from `model.path` again;
- the export is the merged model (`merged`: W + alpha / rank * B @ A, what transformers and vLLM load as
  any checkpoint) with the adapter in peft's own format beside it (`write_adapter`, under `adapter/`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.config import ConfigError
from agentrl.learner.config import LoraSpec

ADAPTER = "default"  # the one adapter's name inside the layers
_A, _B, _BASE = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight", ".base_layer."


def peft_config(spec: LoraSpec, base: str | None = None) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=spec.target_modules, base_model_name_or_path=base)


def linear_names(lm: nn.Module) -> list[str]:
    """The last name part of each Linear module of `lm` (what target_modules name), in order, once each."""
    return list(dict.fromkeys(n.rsplit(".", 1)[-1] for n, m in lm.named_modules() if isinstance(m, nn.Linear)))


def add_lora(lm: nn.Module, spec: LoraSpec, key: str = "model.lora") -> nn.Module:
    """`lm` with LoRA layers on `spec.target_modules` and only those trainable; ConfigError naming `key`
    when a target module is not in the model."""
    from peft import inject_adapter_in_model

    if isinstance(spec.target_modules, list):
        have = linear_names(lm)
        missing = [t for t in spec.target_modules if t.rsplit(".", 1)[-1] not in have]
        if missing:
            raise ConfigError(f"{key}.target_modules: {missing} is not a Linear module of this model; its Linear "
                              f"modules are: {', '.join(have)}")
    try:
        lm = inject_adapter_in_model(peft_config(spec), lm)
    except ValueError as e:  # peft's own checks (e.g. a module type it cannot adapt)
        raise ConfigError(f"{key}: {e}") from None
    from peft.tuners.lora import LoraLayer

    if any(getattr(m, "fan_in_fan_out", False) for m in lm.modules() if isinstance(m, LoraLayer)):
        raise ConfigError(f"{key}: this model stores some adapted weights transposed (GPT-2's Conv1D layers); "
                          "LoRA here adapts Linear layers: name Linear modules in target_modules")
    for name, param in lm.named_parameters():
        param.requires_grad_(is_adapter(name))
    return lm


def round_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Round `model`'s frozen weights through `dtype` in place (kept in their own dtype): an engine's copy of
    the base then holds what a learner keeping its base in `dtype` holds, which no adapter push corrects."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                param.copy_(param.to(dtype))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def has_adapter(module: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in module.named_parameters())


def adapter_names(module: nn.Module) -> set[str]:
    """The names of the adapters loaded into `module`'s LoRA layers (one, however many pushes it took)."""
    from peft.tuners.lora import LoraLayer

    return {name for m in module.modules() if isinstance(m, LoraLayer) for name in m.lora_A}


@contextlib.contextmanager
def adapter_off(module: nn.Module) -> Iterator[None]:
    """`module` as its base model while inside: every LoRA layer passes its input to the base layer alone.
    Each layer's switch and its parameters' requires_grad are put back as they were (peft's switch also
    freezes the adapter, which FSDP must never see: it sets up gradients at the first forward)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    before = [(layer.disable_adapters, [(p, p.requires_grad) for p in layer.parameters()]) for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    for _, grads in before:
        for p, wanted in grads:
            p.requires_grad_(wanted)
    try:
        yield
    finally:
        for layer, (disabled, grads) in zip(layers, before, strict=True):
            layer.enable_adapters(not disabled)
            for p, wanted in grads:
                p.requires_grad_(wanted)


def set_dropout(module: nn.Module, training: bool) -> None:
    """Switch the adapters' dropout on (a training forward) or off; the rest of the model stays in eval."""
    from peft.tuners.lora import LoraLayer

    for m in module.modules():
        if isinstance(m, LoraLayer):
            m.lora_dropout.train(training)


def merged(state: dict[str, Tensor], spec: LoraSpec) -> dict[str, Tensor]:
    """A full state dict of an adapted model as the base model's names, each adapted weight merged:
    W + alpha / rank * B @ A (in float32, then in W's dtype); the adapter tensors go."""
    scale = spec.alpha / spec.rank
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if _BASE not in name:
            out[name] = tensor
            continue
        layer, kind = name.split(_BASE)
        if kind == "weight":
            delta = state[layer + _B].float() @ state[layer + _A].float()
            tensor = (tensor.float() + scale * delta).to(tensor.dtype)
        out[f"{layer}.{kind}"] = tensor
    return out


def write_adapter(path: Path, state: dict[str, Tensor], spec: LoraSpec, base: str | None) -> None:
    """The adapter in peft's saved format (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained(base_model, path)` loads; `base`: the base model's path, recorded."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{n.replace(f'.{ADAPTER}.', '.')}": t.contiguous()
               for n, t in state.items() if is_adapter(n)}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config(spec, base).save_pretrained(str(path))


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_merged(path: str | Path, dtype: Any = "auto") -> tuple[nn.Module, str]:
    """The base model the adapter at `path` names with the adapter merged in, and that base's path (for its
    tokenizer): what `agentrl eval --model <export>/adapter` serves."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(path) / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise ConfigError(f"{path}: the adapter names the base model {base!r}, which is not a local directory; "
                          "evaluate the merged export beside it instead (the directory above)")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(path)).merge_and_unload(), base
