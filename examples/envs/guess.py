"""A number-guessing game as an environment (examples/guess.yaml): one game per trajectory.

The row gives the secret and its range; each `guess` the model makes is answered "higher" or "lower" until it
finds the number, which ends the episode with reward 1, or runs out of guesses, which ends it with 0. The
state (the secret, the guesses so far) belongs to one trajectory: agentrl makes one `GuessNumber` for each
and resets it from the row before the model's first turn.
"""

from __future__ import annotations

from typing import Any

from agentrl.environments import Environment, Step


class GuessNumber(Environment):
    tools = ("guess",)

    def __init__(self, max_guesses: int = 7) -> None:
        self.max_guesses = max_guesses

    def reset(self, row: dict[str, Any]) -> None:
        self.secret, self.low, self.high = int(row["secret"]), int(row["low"]), int(row["high"])
        self.guesses = 0

    def guess(self, number: int) -> Step | str:
        """Guess the secret number; the answer says whether it is higher or lower.

        Args:
            number: the guess, a whole number in the range the question gives.
        """
        if not self.low <= number <= self.high:
            return f"{number} is outside the range {self.low} to {self.high}."
        self.guesses += 1
        if number == self.secret:
            return Step(f"{number} is right, found in {self.guesses} guesses.", done=True, reward=1.0)
        if self.guesses >= self.max_guesses:
            return Step(f"{number} is wrong, and that was the last of {self.max_guesses} guesses.", done=True,
                        reward=0.0)
        return f"The number is {'higher' if number < self.secret else 'lower'} than {number}."
