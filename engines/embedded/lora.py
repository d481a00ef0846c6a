"""Unmerged multi-LoRA in the embedded engine: every batch row computes with its own request's adapter.

``install`` replaces each targeted ``nn.Linear`` of the engine's model with a ``LoraLinear`` that keeps the
base ``weight`` / ``bias`` under their own names (a full weight load still finds ``q_proj.weight``) and one
``lora_A.<name>`` / ``lora_B.<name>`` pair per adapter -- peft's names, so a sync of the trainer's adapter
tensors is a plain by-name ``update_weights``. The output is peft's: ``base(x) + lora_B(lora_A(x)) * scaling``,
in that order, so rollout and trainer logprobs agree.

Which adapter a row uses: a request carries ``SamplingParams.lora_path`` (SGLang's per-request key; None =
the base model). ``attach`` wraps the runner's ``prefill`` / ``decode`` (which take the batch's slots) so
that, before each forward, the shared ``AdapterRows`` holds one adapter index per row, read from the
running request in each slot; ``score`` (no slot) uses the first adapter. No line of the runner changes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class AdapterRows:
    """The adapter index of every row of the batch being run (-1 = base model); None = every row uses 0."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.index = {n: i for i, n in enumerate(names)}
        self.rows: torch.Tensor | None = None

    def of(self, lora_path: str | None) -> int:
        if lora_path is None:
            return -1
        if lora_path not in self.index:
            raise ValueError(f"lora_path {lora_path!r} is not loaded; the engine serves {self.names}")
        return self.index[lora_path]


class LoraLinear(nn.Module):
    """A linear layer with several unmerged LoRA adapters, chosen per batch row (``AdapterRows``)."""

    def __init__(self, base: nn.Linear, rows: AdapterRows) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.lora_A, self.lora_B = nn.ModuleDict(), nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self._rows = rows

    def add(self, name: str, rank: int, scaling: float) -> None:
        """A fresh adapter (B = 0, as peft: the identity update), or ``name``'s re-shaped for a new rank."""
        kw = dict(device=self.weight.device, dtype=self.weight.dtype)
        self.lora_A[name] = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B[name] = nn.Linear(rank, self.out_features, bias=False, **kw)
        nn.init.zeros_(self.lora_B[name].weight)
        self.scaling[name] = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        rows = self._rows.rows
        for i, name in enumerate(self._rows.names):
            if name not in self.lora_A:  # an adapter that does not target this layer
                continue
            a, b, scaling = self.lora_A[name], self.lora_B[name], self.scaling[name]
            if rows is None:
                return y + b(a(x)) * scaling if i == 0 else y
            sel = rows == i
            if bool(sel.any()):
                y[sel] = y[sel] + b(a(x[sel])) * scaling
        return y


def install(model: nn.Module, names: list[str], rank: int, scaling: float, targets: list[str]) -> AdapterRows:
    """Replace every ``nn.Linear`` whose name ends in one of ``targets`` with a ``LoraLinear`` holding ``names``."""
    rows = AdapterRows([])
    for name in names:
        add_adapter(model, rows, name, rank, scaling, targets)
    return rows


def add_adapter(model: nn.Module, rows: AdapterRows, name: str, rank: int, scaling: float,
                targets: list[str]) -> None:
    """Serve one more adapter (or re-create ``name``) on the ``targets`` layers, wrapping them as needed."""
    found = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets
             and (type(m) is nn.Linear or isinstance(m, LoraLinear))]
    if not found:
        raise ValueError(f"no linear layer of the engine's model is named one of {targets}")
    for path, module in found:
        if not isinstance(module, LoraLinear):
            parent, _, attr = path.rpartition(".")
            module = LoraLinear(module, rows)
            setattr(model.get_submodule(parent), attr, module)
        module.add(name, rank, scaling)
    if name not in rows.index:
        rows.index[name] = len(rows.names)
        rows.names.append(name)


def attach(engine: Any, rows: AdapterRows) -> None:
    """Set ``rows`` from the requests in the batch's slots before each prefill / decode of ``engine``."""
    runner = engine.runner

    def by_slot(slots: list[int]) -> torch.Tensor:
        held = {s.slot: s for s in engine._running if s.slot is not None}
        return torch.tensor([rows.of(held[slot].sampling.lora_path) for slot in slots], device=runner.device)

    for method in ("prefill", "decode"):
        inner = getattr(runner, method)

        @functools.wraps(inner)
        def wrapped(slots: list[int], *args: Any, _inner: Any = inner, **kw: Any) -> Any:
            rows.rows = by_slot(slots)
            try:
                return _inner(slots, *args, **kw)
            finally:
                rows.rows = None

        setattr(runner, method, wrapped)
    generate = engine.generate

    @functools.wraps(generate)
    async def checked(input_ids: Any, sampling: Any = None, **kw: Any) -> Any:
        rows.of(getattr(sampling, "lora_path", None))  # an unknown adapter fails its request, not the batch
        return await generate(input_ids, sampling, **kw)

    engine.generate = checked
    engine.lora_rows = rows
