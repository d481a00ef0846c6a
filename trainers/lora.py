"""LoRA in the FSDP2 trainer, through peft: wrap the policy, train the adapters only, send them only.

- ``wrap``: ``peft.get_peft_model`` with one ``LoraConfig`` per adapter (``lora.adapters``), before
  ``fully_shard``; every base weight is frozen, so AdamW only keeps state for adapter parameters.
- ``adapter_weights``: what a weight sync sends -- the adapter tensors under the engine model's names
  (``model.layers.0.self_attn.q_proj.lora_A.default.weight``; peft's own names less ``base_model.model.``),
  which the embedded engine's ``LoraLinear`` modules hold (engines/embedded/lora.py).
- ``save_adapters``: peft's format per adapter, ``<dir>/<name>/adapter_config.json`` +
  ``adapter_model.safetensors``, loadable by ``peft.PeftModel.from_pretrained(base, <dir>/<name>)``.
- Multi-LoRA: ``active`` makes one adapter the one every LoRA layer computes, without touching
  ``requires_grad`` (the sharded parameters stay as they are); the other adapters get no gradient, so
  AdamW leaves them alone. ``split`` groups a batch's trajectories by the adapter their task routes to.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from miles_agent.errors import UserError
from miles_agent.trainers.lora_options import LoraSection

PEFT_PREFIX = "base_model.model."


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError("lora.rank > 0 needs peft: pip install 'miles-agent[lora]' (or pip install peft)") from None
    return peft


def peft_config(lora: LoraSection) -> Any:
    return _peft().LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=lora.targets, bias="none", task_type="CAUSAL_LM")


def wrap(model: nn.Module, lora: LoraSection) -> nn.Module:
    """The policy as a peft model with every adapter of ``lora`` (the first one active)."""
    peft = _peft()
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in lora.targets if t not in present]
    if missing:
        raise UserError(f"lora.target_modules names {missing}, which the model has no linear layer called; "
                        f"it has {sorted(present)}")
    names = lora.names
    wrapped = peft.get_peft_model(model, peft_config(lora), adapter_name=names[0])
    for name in names[1:]:
        wrapped.add_adapter(name, peft_config(lora))
    for pname, p in wrapped.named_parameters():  # add_adapter leaves new adapters frozen
        p.requires_grad_(".lora_" in pname)
    return wrapped


def lora_layers(model: nn.Module) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def active(model: nn.Module, adapter: str) -> Iterator[None]:
    """Every LoRA layer computes ``adapter`` inside the block (the first adapter again after it)."""
    layers = lora_layers(model)
    before = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = [adapter]
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._active_adapter = b


def engine_name(peft_name: str) -> str:
    return peft_name.removeprefix(PEFT_PREFIX)


def adapter_weights(model: nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The adapter tensors, full (one all-gather each: a collective), under the engine's names."""
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
            yield engine_name(name), full.to(dtype)


def trainable_fraction(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts (global numels, under FSDP2 too)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def save_adapters(model: nn.Module, lora: LoraSection, path: Path, rank: int,
                  dtype: torch.dtype = torch.float32) -> None:
    """Each adapter in peft's format under ``path/<name>`` (a collective; rank 0 writes)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    full = {PEFT_PREFIX + n: t for n, t in adapter_weights(model, dtype)}
    if rank != 0:
        return
    peft_model = model
    for name in lora.names:
        out = Path(path) / name
        out.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(peft_model, state_dict=full, adapter_name=name)
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        cfg = peft_model.peft_config[name]
        cfg.save_pretrained(str(out))
    (Path(path) / "adapters.json").write_text(json.dumps({"adapters": lora.names, "routes": lora.routes}))


def split(trajectories: Sequence[Any], lora: LoraSection) -> dict[str, list[int]]:
    """Trajectory indices per adapter, in adapter order (adapters with no trajectory are left out)."""
    out: dict[str, list[int]] = {}
    for i, t in enumerate(trajectories):
        out.setdefault(lora.route(t.task_id), []).append(i)
    return {n: out[n] for n in lora.names if n in out}


def sub_batch(batch: Any, idx: list[int]) -> Any:
    """The rows ``idx`` of a TrainBatch (every per-trajectory field)."""
    import dataclasses

    def pick(rows: Any) -> Any:
        return None if rows is None else [rows[i] for i in idx]

    return dataclasses.replace(batch, trajectories=pick(batch.trajectories), advantages=pick(batch.advantages),
                               old_logprobs=pick(batch.old_logprobs), ref_logprobs=pick(batch.ref_logprobs),
                               teacher_logprobs=pick(batch.teacher_logprobs))


class LoraSteps:
    """The policy trainer's step and logprobs per adapter (mixed into FSDP2Trainer): with one adapter they
    are the plain ones; with several, each adapter steps on its own tasks' trajectories, and its metrics
    are also reported under ``lora/<adapter>/``. The step counter advances once per batch."""

    lora: LoraSection | None
    model: nn.Module

    def train_step(self, batch: Any) -> dict[str, float]:
        if self.lora is None or len(self.lora.names) == 1:
            return super().train_step(batch)  # type: ignore[misc]
        groups = split(batch.trajectories, self.lora)
        start, merged, out = self.step, {}, {}
        for name, idx in groups.items():
            self.step = start
            with active(self.model, name):
                metrics = super().train_step(sub_batch(batch, idx))  # type: ignore[misc]
            out.update({f"lora/{name}/{k}": v for k, v in metrics.items()})
            out[f"lora/{name}/reward_mean"] = sum(batch.trajectories[i].reward or 0.0 for i in idx) / len(idx)
            for k, v in metrics.items():
                merged.setdefault(k, []).append(v)
        self.step = start + 1
        out.update({k: sum(v) / len(v) for k, v in merged.items()})
        return out

    def compute_logprobs(self, trajectories: Sequence[Any], reference: bool = False) -> list[list[float]]:
        if self.lora is None or len(self.lora.names) == 1 or reference:
            return super().compute_logprobs(trajectories, reference)  # type: ignore[misc]
        out: list[list[float]] = [[] for _ in trajectories]
        for name, idx in split(trajectories, self.lora).items():
            with active(self.model, name):
                rows = super().compute_logprobs([trajectories[i] for i in idx])  # type: ignore[misc]
            for i, row in zip(idx, rows):
                out[i] = row
        return out
