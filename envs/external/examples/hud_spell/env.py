"""An example HUD environment (imports hud: it runs only in the HUD side-car's venv).

One task template, ``spell(word)``: HUD's template protocol is an async generator that yields the
prompt, receives the agent's final answer, and yields the reward -- here the fraction of the word's
distinct letters the answer contains. Small on purpose: the adapter test recomputes that rule on
the text the model produced and checks it against the reward HUD reports.
"""

from __future__ import annotations

from hud import Environment

env = Environment("miles-hud-spell")


def letter_score(word: str, answer: str) -> float:
    letters = set(word)
    return len(letters & set(answer.lower())) / len(letters)


@env.template(id="spell", description="Spell a word; reward = fraction of its letters in the answer.")
async def spell(word: str):
    answer = yield f"Spell the word '{word}'. Reply with the word only."
    yield letter_score(word, str(answer or ""))
