"""Trainer offload (colocation): the state leaves the device and comes back bit for bit.

On CPU the move is host to host, so what is checked is the mechanism itself: while offloaded, every
parameter shard, gradient and optimizer-state tensor of the trainer holds 0 bytes of storage (the
memory really was handed back), the same tensor objects are restored, and a run that offloads between
every step trains bit-identically (loss, grad norm, weights, Adam moments) to one that never does.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles_agent.components import offload_enabled
from miles_agent.errors import UserError
from tests.trainers.test_fsdp2_trainer import constant_advantages, make_trainer, make_trajectories, weights

ADV = [1.0, -0.5, 0.75, -1.0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _adam_state(trainer) -> list[torch.Tensor]:
    return [_local(v).clone() for s in trainer.optimizer.state.values() for v in s.values()]


def test_offload_between_steps_trains_bit_identically_and_really_frees_the_storages():
    plain = make_trainer(kl_coef=0.05)  # with a reference model, which is offloaded too
    trajs = make_trajectories(plain)
    plain_metrics = [plain.train_step(constant_advantages(trajs, ADV)) for _ in range(3)]
    plain_w, plain_adam = weights(plain), _adam_state(plain)
    plain.close()

    t = make_trainer(kl_coef=0.05)
    model_params = list(t.model.parameters())
    params = [_local(p) for p in model_params]
    assert t.memory.resident_bytes() >= sum(p.numel() * p.element_size() for p in params) > 0
    metrics = []
    for _ in range(3):
        metrics.append(t.train_step(constant_advantages(trajs, ADV)))
        state = [_local(v) for s in t.optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert len(state) == 2 * len(params)  # exp_avg and exp_avg_sq per parameter shard
        before, resident = [x.clone() for x in params + state], t.memory.resident_bytes()
        out = t.offload()
        assert out["offload_bytes"] == resident >= sum(x.numel() * x.element_size() for x in before)
        # released: every parameter shard, reference shard and Adam moment has no storage left
        assert t.memory.resident_bytes() == 0
        assert all(x.untyped_storage().nbytes() == 0 for x in params + state)
        assert all(_local(p).untyped_storage().nbytes() == 0 for p in t.ref_model.parameters())
        assert t.offload()["offload_bytes"] == 0  # idempotent
        assert t.reload()["reload_bytes"] == resident and t.memory.resident_bytes() == resident
        # the same tensor objects (the optimizer's keys, FSDP2's shards) hold the same bytes
        assert all(a is b for a, b in zip(t.model.parameters(), model_params))
        assert set(t.optimizer.state) == set(model_params)
        for x, b in zip(params + state, before):
            assert torch.equal(x, b)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in plain_metrics]
    assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in plain_metrics]
    w = weights(t)
    assert list(w) == list(plain_w) and all(torch.equal(w[k], plain_w[k]) for k in w)
    assert all(torch.equal(a, b) for a, b in zip(_adam_state(t), plain_adam))
    t.close()


def test_offload_before_the_first_step_has_no_optimizer_state_yet():
    t = make_trainer()
    trajs = make_trajectories(t)
    t.offload()
    assert t.memory.resident_bytes() == 0
    t.reload()
    m = t.train_step(constant_advantages(trajs, ADV))  # Adam's state is created after the reload
    assert m["loss"] == m["loss"] and t.optimizer.state
    t.close()


@pytest.mark.parametrize(("value", "colocate", "mode", "expected"), [
    ("auto", True, "ray", True), ("auto", False, "ray", False), ("auto", True, "inprocess", False),
    (False, True, "ray", False), (True, False, "ray", True)])
def test_offload_setting(value, colocate, mode, expected):
    assert offload_enabled(value, colocate=colocate, mode=mode) is expected


def test_offload_setting_refuses_what_cannot_work():
    with pytest.raises(UserError, match="cluster.mode=ray"):
        offload_enabled(True, colocate=False, mode="inprocess")
    with pytest.raises(UserError, match="auto, true or false"):
        offload_enabled("yes", colocate=True, mode="ray")
