"""A tiny byte-level BPE tokenizer for runs of tiny random models on a CPU, where no tokenizer can be
downloaded. `configs/tiny_tokenizer/` is its output (`python -m agentrl.quickstart.tokenizer OUT`): 512
tokens learned from the ToRL prompt, arithmetic and short Python programs, with Qwen's chat markers as
special tokens (`<|endoftext|>` 0 pads, `<|im_end|>` 2 ends a turn) and a ChatML template. Byte-level,
so any text encodes; the merges only make the common texts short.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
    "User: Please integrate natural language reasoning with programs to solve the problem above, and put your "
    "final answer within \\boxed{}.\n",
    "What is 12 + 34? Assistant:\nLet me compute.\n```python\nprint(12 + 34)\n```\n```output\n46\n```\n"
    "The answer is \\boxed{46}.",
    "What is 7 * 8 - 9? ```python\nx = 7 * 8 - 9\nprint(x)\n```\n```output\n47\n```\nSo \\boxed{47}.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 + - * / = ( ) answer result",
    "<search> query </search> <information> Doc 1(Title: \"Paris\") Paris is the capital. </information> "
    "<answer> Paris </answer>",
]


def train(texts: list[str], out: str | Path, vocab_size: int = 512, split_digits: bool = False) -> Path:
    """A byte-level BPE tokenizer learned from `texts`, saved to `out` with Qwen's chat markers and a
    ChatML template. `split_digits`: every digit its own token, so that a number is copied digit by digit
    (a model that must copy numbers into a program learns that far sooner than copying merged chunks)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return Path(out)


def build(out: str | Path) -> Path:
    """`configs/tiny_tokenizer/`: 512 tokens learned from the texts above."""
    return train(_CORPUS * 50, out)


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else "configs/tiny_tokenizer")
