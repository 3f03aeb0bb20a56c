"""Random-weight checkpoints for machines that cannot download weights: GPU equivalence tests and
throughput benchmarks (throughput does not depend on weight values).

`write_random_checkpoint` builds a Qwen2 causal LM of a named shape with the given tokenizer and saves it
in Hugging Face format, which both transformers (engine/hf.py) and vLLM (engine/vllm.py) load.
`sharpen` multiplies the (tied) embedding so logits have margins far above bf16 rounding: a random
model's next-token distribution is otherwise so flat that two correct implementations pick different
greedy tokens from rounding noise alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B, -1.5B and -7B (the published configs' shapes).
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}


def write_random_checkpoint(out: str | Path, tokenizer: Any, shape: str = "qwen2.5-0.5b", *, seed: int = 0,
                            dtype: str = "bfloat16", sharpen: float = 1.0, max_position_embeddings: int = 32768,
                            vocab_size: int | None = None, device: str = "cpu") -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of: {', '.join(SHAPES)}")
    out = Path(out)
    # Embedding rows beyond the tokenizer are padding, as in the published Qwen checkpoints (151,936 rows).
    vocab = vocab_size or (len(tokenizer) + 127) // 128 * 128
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    eos = tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=max_position_embeddings, rope_theta=1_000_000.0,
                         eos_token_id=eos, bos_token_id=eos, torch_dtype=dtype, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    if sharpen != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # an engine started next in this process sizes its cache from free memory
    return out
