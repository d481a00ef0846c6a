from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles_agent.models.builder import build_tiny


def tiny_hf_checkpoint(arch: str, tmp: Path, seed: int = 0):  # noqa: ANN201
    """(model, HF checkpoint tensors as written to disk) for a tiny architecture, randomized so that
    norms and embeddings are not all-ones (a layout bug must change the logits)."""
    model, tok = build_tiny(arch, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=g))
    model.save_pretrained(tmp)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(Path(tmp).glob("*.safetensors")):
        tensors.update(load_file(f))
    return model, tensors


# -- the Megatron trainer against the FSDP2 trainer -----------------------------------------------------

PROMPTS = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41, 42, 43, 44, 45]]
# Per sampled token, rollout logprob minus the trainer's: |delta| < 0.15 keeps w = pi_train / pi_rollout
# inside [0.8, 1.25], |delta| > 0.3 puts it well outside (no token sits near a boundary).
ROLLOUT_SHIFTS = [0.05, -0.4, 0.1, 0.35, -0.1, -0.6, 0.0, 0.5]


def trajectories():  # noqa: ANN201
    """Four two-turn trajectories in two groups, with an observation span that does not train."""
    from miles_agent.types import Trajectory

    g = torch.Generator().manual_seed(0)
    out = []
    for i, prompt in enumerate(PROMPTS):
        t = Trajectory(prompt_ids=list(prompt), group_id=str(i % 2))
        ids = torch.randint(60, 200, (9,), generator=g).tolist()
        t.append_model(ids[:3 + i % 3], [-1.5] * (3 + i % 3), weight_version=0, turn=0)
        t.append_observation(ids[6:8], turn=0)
        t.append_model(ids[8:], [-2.0], weight_version=0, turn=1)
        t.reward = float(i % 2)
        out.append(t.validate())
    return out


def near_rollout_logprobs(trajs, trainer_logprobs) -> None:  # noqa: ANN001
    """Set each sampled token's rollout logprob to the trainer's shifted by ROLLOUT_SHIFTS (cycled), so
    the mismatch corrections keep some tokens, truncate or mask others."""
    k = 0
    for t, row in zip(trajs, trainer_logprobs):
        for j, m in enumerate(t.loss_mask):
            if m:
                t.rollout_logprobs[j] = row[j] + ROLLOUT_SHIFTS[k % len(ROLLOUT_SHIFTS)]
                k += 1


def advantages(trajs) -> list[list[float]]:  # noqa: ANN001
    return [[(1.0 if i % 2 else -0.5) + 0.1 * j for j in range(t.response_length)] for i, t in enumerate(trajs)]


@contextlib.contextmanager
def trainer_pair(arch: str, train, algo, seed: int = 3):  # noqa: ANN001, ANN201
    """(FSDP2 trainer, Megatron trainer) on the same tiny weights, closed afterwards."""
    import torch.distributed as dist

    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.trainers.megatron.options import MegatronConfig
    from miles_agent.trainers.megatron.trainer import MegatronTrainer

    trainers = []
    try:
        model, tok = build_tiny(arch, seed=seed)
        trainers.append(MegatronTrainer(model, tok, train, algo, temperature=0.8, megatron=MegatronConfig()))
        model, tok = build_tiny(arch, seed=seed)
        trainers.insert(0, FSDP2Trainer(model, tok, train, algo, temperature=0.8))
        yield trainers
    finally:
        for t in trainers[::-1]:
            t.close()
        assert not dist.is_initialized()


def assert_same_metrics(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=2e-4, abs=2e-6), k


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        initial: dict[str, torch.Tensor]) -> None:
    """Same tensors within float noise, and most of them really moved (the update did something)."""
    assert set(got) == set(want)
    moved = 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=2e-5, msg=k)
        moved += int(not torch.equal(want[k], initial[k]))
    assert moved > len(want) // 2
