"""The order in which a run sees its data: a seeded permutation per epoch, resumable from its position.

The trainer draws prompts from it, `agentrl sft` its trajectories; `state` (epoch, index, seed) is kept in
each checkpoint, so a resumed run draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class PromptSampler(Generic[T]):
    """Items (prompts; sft.py's trajectories) in a seeded permutation per epoch; `state` (epoch, index,
    seed) resumes the same order."""

    def __init__(self, prompts: Sequence[T], seed: int, epoch: int = 0, index: int = 0) -> None:
        self.prompts, self.seed, self.epoch, self.index = prompts, seed, epoch, index

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[tuple[int, T]]:
        """The next `k` prompts, each with its epoch, across epoch boundaries."""
        out = []
        order = self._order(self.epoch)
        while len(out) < k:
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
                order = self._order(self.epoch)
            out.append((self.epoch, self.prompts[order[self.index]]))
            self.index += 1
        return out

    @property
    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}
