"""An example OpenEnv environment (imports openenv: it runs only in the OpenEnv side-car's venv).

Spell-a-word: reset(seed) picks a word, the observation asks for it; each step scores the reply by
the fraction of the word's letters it contains (its rubric in miniature), and the episode ends on
a perfect reply or after two attempts. Small on purpose: the adapter test checks the reward that
OpenEnv reports against the same rule applied to the text the model produced.
"""

from __future__ import annotations

from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State

WORDS = ("apple", "river", "cloud", "stone", "light", "bread")
MAX_ATTEMPTS = 2


def letter_score(word: str, reply: str) -> float:
    """Fraction of the word's distinct letters that appear in the reply (case-insensitive)."""
    letters = set(word)
    return len(letters & set(reply.lower())) / len(letters)


class SpellAction(Action):
    message: str


class SpellObservation(Observation):
    message: str = ""


class SpellEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.word = WORDS[0]

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SpellObservation:
        self.word = WORDS[(seed or 0) % len(WORDS)]
        self._state = State(episode_id=episode_id, step_count=0)
        return SpellObservation(message=f"Write the word '{self.word}'.", reward=0.0)

    def step(self, action: SpellAction, timeout_s: float | None = None, **kwargs: Any) -> SpellObservation:
        self._state.step_count += 1
        score = letter_score(self.word, action.message)
        done = score == 1.0 or self._state.step_count >= MAX_ATTEMPTS
        hint = "" if done else f"Not quite. Write exactly: {self.word}"
        return SpellObservation(message=hint, reward=score, done=done)

    @property
    def state(self) -> State:
        return self._state
