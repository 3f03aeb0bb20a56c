"""The models and prompts the vLLM GPU tests share: two random-weight Qwen2.5-0.5B-shaped checkpoints
(seeds 0 and 1) in float32, sharpened so greedy choices compare implementations, not rounding
(agentrl/engine/random_model.py), with the real Qwen2.5 tokenizer (AGENTRL_TOKENIZER, else ../shared's); and a wait
for a closed engine's GPU memory before the next engine starts."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.engine.random_model import write_random_checkpoint


def two_models_and_prompts(tmp_path_factory: Any, n_prompts: int) -> tuple[Any, Path, Path, list[list[int]]]:
    """(tokenizer, checkpoint a, checkpoint b, `n_prompts` tokenized prompts); skips without a tokenizer."""
    from transformers import AutoTokenizer

    from tests.conftest import QWEN_DIR

    tok_dir = os.environ.get("AGENTRL_TOKENIZER") or str(QWEN_DIR)
    if not (Path(tok_dir) / "tokenizer_config.json").exists():
        pytest.skip(f"no Qwen2.5 tokenizer at {tok_dir}: set AGENTRL_TOKENIZER to one (../shared has it)")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    root = tmp_path_factory.mktemp("models")
    kw = dict(dtype="float32", sharpen=8.0, max_position_embeddings=4096)
    a = write_random_checkpoint(root / "a", tok, "qwen2.5-0.5b", seed=0, **kw)
    b = write_random_checkpoint(root / "b", tok, "qwen2.5-0.5b", seed=1, **kw)
    prompts = [tok.encode(f"Problem {i}: compute {i} * {i + 3} and explain the steps.") for i in range(n_prompts)]
    return tok, a, b, prompts


def wait_for_free_gpu_memory(fraction: float, timeout_s: float = 120.0) -> None:
    """Block until every visible GPU has `fraction` of its memory free: a shut-down engine's processes
    release theirs asynchronously, and the next engine's `gpu_memory_utilization` check must see it."""
    deadline = time.monotonic() + timeout_s
    while True:
        short = [(d, *torch.cuda.mem_get_info(d)) for d in range(torch.cuda.device_count())]
        short = [(d, free, total) for d, free, total in short if free < fraction * total]
        if not short:
            return
        if time.monotonic() > deadline:
            d, free, total = short[0]
            raise RuntimeError(f"GPU {d} memory not released after {timeout_s:.0f} s: {free / 2**30:.1f} GiB free "
                               f"of {total / 2**30:.1f}, {fraction:.0%} expected")
        time.sleep(0.5)
