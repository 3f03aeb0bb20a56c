"""A synthetic wiki-18-format corpus and matching queries, for the tests and bench/bench_retriever.py.

Pseudo-words made of syllables, grouped into topics: each passage mixes words of its topic with
Zipf-distributed common words, under a `"Title"` line. 55 words make ~140 MiniLM tokens, the length of a
100-word wiki-18 passage (pseudo-words split into more word pieces than English does). Queries are a
few words of one topic. Deterministic for a seed, so recall figures are comparable from run to run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

_CONSONANTS = list("bcdfghklmnprstvz")
_VOWELS = list("aeiou")
_TOPIC_WORDS = 60


def _vocabulary(rng: np.random.Generator, size: int) -> list[str]:
    """`size` distinct pseudo-words of 2 or 3 consonant-vowel syllables."""
    syllables = np.array([c + v for c in _CONSONANTS for v in _VOWELS])
    words: dict[str, None] = {}
    while len(words) < size:
        picks = rng.integers(0, len(syllables), size=(size, 3))
        lengths = rng.integers(2, 4, size=size)
        for row, n in zip(picks, lengths, strict=True):
            words.setdefault("".join(syllables[row[:n]]), None)
    return sorted(words)[:size]


class SyntheticCorpus:
    def __init__(self, n_passages: int, seed: int = 0, words_per_passage: int = 55) -> None:
        self.n = n_passages
        self.seed = seed
        self.words_per_passage = words_per_passage
        rng = np.random.default_rng(seed)
        self.vocab = _vocabulary(rng, 6000)
        self.n_topics = max(8, n_passages // 100)
        self.topics = rng.integers(0, len(self.vocab), size=(self.n_topics, _TOPIC_WORDS))
        zipf = 1.0 / np.arange(1, len(self.vocab) + 1)
        self.common_cdf = np.cumsum(zipf / zipf.sum())

    def _words(self, rng: np.random.Generator, topic: int, n: int, topic_share: float) -> list[str]:
        from_topic = rng.random(n) < topic_share
        ids = np.where(
            from_topic,
            self.topics[topic][rng.integers(0, _TOPIC_WORDS, size=n)],
            np.minimum(np.searchsorted(self.common_cdf, rng.random(n)), len(self.vocab) - 1),
        )
        return [self.vocab[i] for i in ids]

    def passages(self) -> Iterator[dict[str, str]]:
        rng = np.random.default_rng(self.seed + 1)
        for i in range(self.n):
            topic = int(rng.integers(0, self.n_topics))
            title = " ".join(self._words(rng, topic, 2, 1.0)).title()
            body = " ".join(self._words(rng, topic, self.words_per_passage, 0.5))
            yield {"id": str(i), "contents": f'"{title}"\n{title} {body}.'}

    def queries(self, n: int, words: int = 6) -> list[str]:
        rng = np.random.default_rng(self.seed + 2)
        return [" ".join(self._words(rng, int(rng.integers(0, self.n_topics)), words, 0.8)) for _ in range(n)]

    def write(self, path: Path) -> Path:
        with open(path, "w") as f:
            for passage in self.passages():
                f.write(json.dumps(passage) + "\n")
        return path
