"""The ``lora`` config section (entry point of ``miles_agent.sections``): LoRA and multi-LoRA RL.

``lora.rank > 0`` turns it on: the trainer wraps the policy with peft and trains the adapters only, the
weight sync moves the adapter tensors only, and the embedded engine serves the adapters unmerged, one per
request (docs/lora.md). Every request of an episode is routed to one adapter by its task (``route``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_agent.errors import UserError

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass(frozen=True)
class LoraSection:
    """LoRA adapters on the policy (0 = full fine-tuning); see docs/lora.md."""

    rank: int = 0  # the adapters' rank r; 0 = no LoRA (full fine-tuning)
    alpha: float = 16.0  # peft's lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # peft's lora_dropout; > 0 makes the trainer's logprobs differ from the rollout's
    target_modules: str = DEFAULT_TARGETS  # comma-separated nn.Linear names (peft's target_modules)
    adapters: list[str] = field(default_factory=list)  # adapter names, [] = one adapter named "default"
    routes: dict[str, str] = field(default_factory=dict)  # task-id prefix -> adapter; others: the first

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise UserError(f"lora.rank must be >= 0 (0 = full fine-tuning), got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise UserError("lora.target_modules is empty; name the linear layers, e.g. q_proj,v_proj")
        names = self.names
        if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise UserError(f"lora.adapters must be distinct identifiers, e.g. [add, mul], got {names}")
        bad = sorted(set(self.routes.values()) - set(names))
        if bad:
            raise UserError(f"lora.routes sends tasks to {bad[0]!r}, which is not in lora.adapters ({names}); "
                            "add it to lora.adapters or fix the route")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def names(self) -> list[str]:
        return list(self.adapters) or ["default"]

    @property
    def targets(self) -> list[str]:
        return [t.strip() for t in self.target_modules.split(",") if t.strip()]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def route(self, task_id: str) -> str:
        """The adapter of a task: the longest matching ``routes`` prefix, else the first adapter."""
        hits = [p for p in self.routes if task_id.startswith(p)]
        return self.routes[max(hits, key=len)] if hits else self.names[0]

    def wrap_harness(self, harness: Any) -> Any:
        """The harness, its requests routed to the episode's adapter (build.build_harness calls this)."""
        return RoutedHarness(harness, self) if self.enabled else harness


class AdapterPolicy:
    """A policy (engine) whose every ``generate`` carries ``lora_path=adapter`` (SGLang's per-request key)."""

    def __init__(self, policy: Any, adapter: str) -> None:
        self._policy, self.adapter = policy, adapter

    async def generate(self, input_ids: Sequence[int], sampling: Any = None, **kw: Any) -> Any:
        import dataclasses

        from miles_agent.engine import SamplingParams

        sampling = dataclasses.replace(sampling or SamplingParams(), lora_path=self.adapter)
        return await self._policy.generate(input_ids, sampling, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


class RoutedHarness:
    """A harness whose episodes talk to their task's adapter; everything else is the wrapped harness's."""

    def __init__(self, harness: Any, lora: LoraSection) -> None:
        self._harness, self._lora = harness, lora

    async def run(self, task: Any, session: Any, policy: Any, *args: Any, **kw: Any) -> Any:
        trajs = await self._harness.run(task, session, AdapterPolicy(policy, self._lora.route(task.id)), *args, **kw)
        return trajs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._harness, name)
