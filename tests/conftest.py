"""Shared fixtures: the repo and ../shared locations, a tiny tokenizer trained here, the real Qwen one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
QWEN_DIR = SHARED / "tokenizers" / "qwen2.5-0.5b-instruct"

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def shared_file(relative: str) -> Path:
    """A file under ../shared/data, or skip the test saying why."""
    path = SHARED / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: this test needs the shared benchmark files beside the repo")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer trained in a second on a few sentences, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "A conversation between User and Assistant. The user asks a question.",
        "Compute 2 + 3 and put the answer in \\boxed{5}. ```python\nprint(2 + 3)\n```\n```output\n5\n```",
        "<search> who wrote hamlet </search> <information> Doc 1 </information> <answer> Shakespeare </answer>",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The real Qwen2.5-Instruct tokenizer from ../shared (skips where it is absent)."""
    if not (QWEN_DIR / "vocab.json").exists():
        pytest.skip(f"{QWEN_DIR} is absent: this test needs the real Qwen2.5 tokenizer from ../shared")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(QWEN_DIR)


def ray_token_mode() -> None:
    """Ray's token authentication, stated for both sides before Ray reads its config (at import): where
    ~/.ray/auth_token exists, a head started there requires the token, while a driver joining it sends it only
    with RAY_AUTH_MODE=token; where it does not, token mode makes `ray start` fail for want of a token."""
    if (Path.home() / ".ray" / "auth_token").exists():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def process_gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether process `pid` is gone (or a zombie left to be reaped) before the deadline."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
