"""An example Verifiers v1 taskset (imports verifiers: it runs only in the Verifiers side-car's venv).

Spell-a-word, scored by a verifiers reward function: the fraction of the word's distinct letters in
the final reply. A package named like a taskset id, as verifiers resolves tasksets by import.
"""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ("apple", "river", "cloud", "stone", "light", "bread")


class SpellData(vf.TaskData):
    word: str


class SpellTask(vf.Task[SpellData]):
    @vf.reward
    async def letters(self, task, trace) -> float:
        reply = trace.last_reply
        return len(set(task.word) & set(reply.lower())) / len(set(task.word))


class SpellTaskset(vf.Taskset[SpellTask]):
    def load(self):
        for word in WORDS:
            yield SpellTask(SpellData(id=word, prompt=f"Write the word '{word}'.", word=word))


__all__ = ["SpellTaskset"]
