"""Live view of a run: a bar over steps with the current phase, one bar for the phase in progress, and
one summary line per step.

Phase bars: rollout (episodes done, in flight, generated tokens/s), train (micro-batches of the
optimizer step), sync (bytes pushed to the engines, MB/s). Counts come from hooks the loop wires in
(``episode_done``, the trainer's ``on_micro_batch``, ``track_sync`` around the weight stream).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tqdm import tqdm


class Progress:
    def __init__(self, steps: int, start: int = 0, enabled: bool = True,
                 generated_tokens: Callable[[], int] | None = None, concurrency: int | None = None) -> None:
        """``generated_tokens`` reads the engines' running count of sampled tokens (for tokens/s);
        ``concurrency`` caps the episodes in flight at once."""
        self.enabled = enabled
        self.steps = tqdm(total=steps, initial=start, desc="steps", position=0, disable=not enabled,
                          dynamic_ncols=True)
        self.bar: Any = None
        self.phase_name = ""
        self.done, self.total = 0, 0  # the phase bar's count (kept here too: a disabled tqdm counts nothing)
        self._generated_tokens = generated_tokens
        self._concurrency = concurrency
        self._tokens0, self._t0 = 0, 0.0

    def _new_bar(self, **kw: Any) -> None:
        self._close_bar()
        self.bar = tqdm(position=1, leave=False, disable=not self.enabled, dynamic_ncols=True, **kw)

    def phase(self, name: str, total: int | None = None) -> None:
        self.steps.set_postfix_str(name)
        self.phase_name = name
        self._tokens0 = self._generated_tokens() if self._generated_tokens else 0
        self._t0 = time.perf_counter()
        self.done, self.total = 0, total or 0
        if name == "rollout":
            self._new_bar(total=total, desc="rollout episodes", unit="ep")
            self._rollout_postfix()
        elif name == "train":
            self._new_bar(total=None, desc="train micro-batches", unit="mb")
        elif name == "sync":
            self._new_bar(total=None, desc="weight sync", unit="B", unit_scale=True, unit_divisor=1024)
        else:
            self._close_bar()

    def rollout_status(self) -> dict[str, float]:
        """Episodes in flight and generated tokens per second since the rollout began."""
        if self.phase_name != "rollout":
            return {}
        left = self.total - self.done
        in_flight = min(left, self._concurrency) if self._concurrency else left
        out = {"in_flight": float(in_flight)}
        if self._generated_tokens:
            elapsed = max(time.perf_counter() - self._t0, 1e-9)
            out["tokens_per_s"] = (self._generated_tokens() - self._tokens0) / elapsed
        return out

    def _rollout_postfix(self) -> None:
        s = self.rollout_status()
        text = f"in flight {int(s.get('in_flight', 0))}"
        if "tokens_per_s" in s:
            text += f", {s['tokens_per_s']:.0f} tok/s"
        self.bar.set_postfix_str(text, refresh=False)

    def episode_done(self, *_: Any) -> None:
        if self.bar is not None and self.phase_name == "rollout":
            self.done += 1
            self.bar.update()
            self._rollout_postfix()

    def micro_batch_done(self, done: int, total: int) -> None:
        if self.bar is not None and self.phase_name == "train":
            self.bar.total, self.total = total, total
            self.bar.update(done - self.done)
            self.done = done

    def track_sync(self, named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Pass the weight stream through, counting bytes on the sync bar as the transport consumes it."""
        for name, t in named_tensors:
            yield name, t
            if self.bar is not None and self.phase_name == "sync":
                nbytes = t.numel() * t.element_size()
                self.done += nbytes
                self.bar.update(nbytes)

    def step_done(self, record: dict[str, Any], line: str) -> None:
        self._close_bar()
        self.steps.update()
        (tqdm.write if self.enabled else print)(line)

    def close(self) -> None:
        self._close_bar()
        self.steps.close()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def generated_tokens(engines: list[Any]) -> int:
    """Tokens sampled so far by engines that count them (the embedded engine's ``stats``)."""
    return sum(int(getattr(e, "stats", {}).get("generated_tokens", 0)) for e in engines)
