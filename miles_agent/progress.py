"""Live view of a run: a bar over steps with the current phase, a bar over each step's episodes, and
one summary line per step."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


class Progress:
    def __init__(self, steps: int, start: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.steps = tqdm(total=steps, initial=start, desc="steps", position=0, disable=not enabled,
                          dynamic_ncols=True)
        self.episodes: Any = None

    def phase(self, name: str, total: int | None = None) -> None:
        self.steps.set_postfix_str(name)
        if name == "rollout":
            self._close_episodes()
            self.episodes = tqdm(total=total, desc="rollout episodes", position=1, leave=False,
                                 disable=not self.enabled, dynamic_ncols=True)
        else:
            self._close_episodes()

    def episode_done(self) -> None:
        if self.episodes is not None:
            self.episodes.update()

    def step_done(self, record: dict[str, Any], line: str) -> None:
        self._close_episodes()
        self.steps.update()
        (tqdm.write if self.enabled else print)(line)

    def close(self) -> None:
        self._close_episodes()
        self.steps.close()

    def _close_episodes(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
            self.episodes = None
