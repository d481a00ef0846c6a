"""Rollout Routing Replay (R3): the trainer's MoE layers route each token to the experts the engine used.

Why: a top-k router is discontinuous. When the engine (bf16, other kernels, other batch shapes) and the
trainer disagree on a near-tie, the token goes to a different expert and its logprob jumps; the error
then spreads to later positions through attention. Replaying the engine's expert ids removes the jump.

Replaying ids alone is not enough (miles #2722: mean error 0.369 natural, 0.139 with ids replayed), so
the gate weights are recomputed consistently: ``softmax`` over the trainer's own router logits (as the
model's router does, in float32), gathered at the replayed ids, renormalized over them when the config
says ``norm_topk_prob``. Gradients still flow into the router through those logits.

How: `install` adds a forward hook to every MoE router (transformers' ``Qwen3MoeTopKRouter`` convention:
it returns ``(router_logits, top_k_weights, top_k_ids)``). The hook does nothing unless a forward runs
inside `replaying(model, ids)`, so the model is unchanged for every other caller. ``ids`` is
``[B, T, moe_layers, top_k]`` for the ``[B, T]`` input; rows holding -1 (the last token, padding,
observation tokens the engine never saw) keep the trainer's own routing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from miles_agent.errors import UserError
from miles_agent.types import Trajectory

NOT_REPLAYED = -1


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of the MoE blocks, in layer order (the order of ``routed_experts``' layer axis)."""
    return [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


class _ReplayState:
    """The ids for the forward in flight; the hooks read it (one per model, set by `replaying`)."""

    def __init__(self, top_k: int, norm_topk_prob: bool) -> None:
        self.ids: Tensor | None = None
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob


def install(model: nn.Module) -> None:
    """Hook every MoE router of ``model`` (idempotent); a dense model is a clear error.

    The state lives on the model and its routers, not in the hook's closure, so a deep copy of the
    model (the KL reference model) replays through its own copy of the state.
    """
    if hasattr(model, "_routing_replay"):
        return
    routers = moe_routers(model)
    if not routers:
        raise UserError(f"algo.routing_replay needs a MoE model; {type(model).__name__} has no MoE layers "
                        "(use model.arch=tiny-qwen3-moe or a MoE checkpoint, or set algo.routing_replay=false)")
    cfg = model.config
    state = _ReplayState(int(cfg.num_experts_per_tok), bool(getattr(cfg, "norm_topk_prob", True)))
    for layer, router in enumerate(routers):
        router._replay_state, router._replay_layer = state, layer
        router.register_forward_hook(_replay_hook)
    model._routing_replay = state  # type: ignore[attr-defined]


@contextlib.contextmanager
def replaying(model: nn.Module, ids: Tensor | None) -> Iterator[None]:
    """Forwards inside this block route by ``ids`` (see the module docstring); ``None`` changes nothing."""
    state: _ReplayState | None = getattr(model, "_routing_replay", None)
    if ids is None or state is None:
        yield
        return
    state.ids = ids
    try:
        yield
    finally:
        state.ids = None


def _replay_hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]) -> tuple | None:
    state: _ReplayState = module._replay_state
    if state.ids is None:
        return None
    logits, _, natural = output
    rows = state.ids[..., module._replay_layer, :].reshape(-1, state.top_k)
    if rows.shape[0] != logits.shape[0]:
        raise ValueError(f"routing replay has {rows.shape[0]} token rows for a forward of {logits.shape[0]}")
    return replay_gate(logits, natural, rows, state.norm_topk_prob)


def replay_gate(logits: Tensor, natural_ids: Tensor, replay_ids: Tensor,
                norm_topk_prob: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(logits, weights, ids) routing to ``replay_ids`` (natural ids where a row is -1), with weights
    recomputed from ``logits`` exactly as the router computes them for its own choice."""
    rows = replay_ids.to(device=natural_ids.device, dtype=natural_ids.dtype)
    ids = torch.where(rows[:, :1] >= 0, rows, natural_ids)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def layout(trajectories: Sequence[Trajectory], indices: Sequence[int], seq_len: int, moe_layers: int,
           top_k: int) -> Tensor:
    """``[B, seq_len, moe_layers, top_k]`` replay ids for a right-padded micro-batch (-1 = not replayed).

    A trajectory without ``routed_experts`` is an error: with replay on, training it with the trainer's
    own routing would silently reintroduce the mismatch R3 exists to remove.
    """
    out = torch.full((max(len(indices), 1), seq_len, moe_layers, top_k), NOT_REPLAYED, dtype=torch.long)
    for b, i in enumerate(indices):
        t = trajectories[i]
        if t.routed_experts is None:
            raise UserError(f"algo.routing_replay is on but trajectory {t.uid} has no routed_experts; the "
                            "rollout must ask the engine for them (return_routed_experts=True)")
        re = torch.as_tensor(t.routed_experts, dtype=torch.long)
        if re.shape[1:] != (moe_layers, top_k):
            raise UserError(f"trajectory {t.uid} routed_experts has {tuple(re.shape[1:])} (layers, top_k) "
                            f"per token but the trained model has ({moe_layers}, {top_k}); the rollout "
                            "and the trainer must serve the same model")
        out[b, :re.shape[0]] = re
    return out
