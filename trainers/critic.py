"""The value model for PPO with GAE: the policy's backbone with a scalar head, trained alongside.

``ValueModel`` copies the policy's transformer (so it starts from the same features) and puts a
zero-initialized linear head on the last hidden state: ``V`` is 0 everywhere at step 0, so the first
advantages are plain discounted returns. It reads the same next-token grid as the policy trainer
(see ``batching``): grid column ``c`` holds the value of the prefix up to input position
``offset + c``, i.e. the state in which the token of that column was chosen.

``CriticTrainer`` shards it with FSDP2 on the policy trainer's process group, computes values and
steps on the clipped value loss (PPO2):
``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)``, token mean over trainable
tokens, with the same mini-batching as the policy (``train.mini_batches`` x ``train.ppo_epochs``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh

from miles_agent.algorithms.losses import aggregate
from miles_agent.config import AlgoConfig, TrainConfig
from miles_agent.errors import UserError
from miles_agent.trainers import checkpoint as ckpt
from miles_agent.trainers import precision
from miles_agent.trainers.batching import MicroBatch, build_micro_batch, pack_micro_batches, rank_plan
from miles_agent.trainers.fsdp2 import init_distributed, shard
from miles_agent.trainers.minibatch import split_mini_batches, to_grid
from miles_agent.trainers.policy_trainer import clip_and_step, local_grad_norm
from miles_agent.types import Trajectory


class ValueModel(nn.Module):
    """A copy of the policy's backbone (``policy.model``) and a scalar value head."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        backbone = getattr(policy, "model", None)
        hidden = getattr(getattr(policy, "config", None), "hidden_size", None)
        if backbone is None or hidden is None:
            raise UserError(f"cannot build a value model from {type(policy).__name__}: it needs an HF causal LM "
                            "with .model (the backbone) and .config.hidden_size")
        self.model = copy.deepcopy(backbone)
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(self.model.parameters()).dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float().clone()  # not a view: FSDP hooks the output


class CriticTrainer:
    def __init__(self, value_model: ValueModel, train: TrainConfig, algo: AlgoConfig, *, pad_id: int = 0,
                 device: str = "cpu") -> None:
        if not algo.critic_lr > 0:
            raise UserError(f"algo.critic_lr must be > 0 (got {algo.critic_lr})")
        self.train_cfg, self.algo, self.pad_id = train, algo, int(pad_id)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        self._owns_group = init_distributed(self.device, train.world_size)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        compute, master = precision.dtypes(value_model, train)  # the policy's mixed precision
        self.model = shard(value_model.to(self.device, master), init_device_mesh(self.device.type, (self.world_size,)),
                           precision.fsdp_policy(compute, master))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.critic_lr, betas=tuple(train.betas),
                                           eps=train.adam_eps, weight_decay=train.weight_decay)
        self.step = 0

    def _values(self, mb: MicroBatch) -> Tensor:
        return self.model(mb.input_ids, mb.attention_mask)[:, mb.offset:-1]

    def _micro_batches(self, trajs: Sequence[Trajectory], plan: list[list[int]],
                       rows: Sequence[Sequence[float]] | None) -> list[MicroBatch]:
        return [build_micro_batch(trajs, idx, rows, self.pad_id).to(self.device) for idx in plan]

    @torch.no_grad()
    def values(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """The value of every response position (0.0 where the model did not sample); every rank
        computes all of them (same plan everywhere)."""
        self.model.eval()
        lengths = [len(t.tokens) for t in trajectories]
        plan = pack_micro_batches(range(len(trajectories)), lengths, self.train_cfg.micro_batch_tokens)
        out: list[list[float]] = [[] for _ in trajectories]
        for mb in self._micro_batches(trajectories, plan, None):
            for i, row in zip(mb.indices, mb.rows_to_lists(self._values(mb))):
                out[i] = row
        return out

    def train_step(self, trajectories: Sequence[Trajectory], returns: Sequence[Sequence[float]],
                   old_values: Sequence[Sequence[float]]) -> dict[str, float]:
        """Regress ``V`` on ``returns`` with the clipped value loss; metrics are means over optimizer steps."""
        cfg, eps = self.train_cfg, self.algo.value_clip
        lengths = [len(t.tokens) for t in trajectories]
        self.model.train()
        totals = {"value_loss": 0.0, "value_clipfrac": 0.0}
        grad_norms = []
        minis = split_mini_batches([t.group_id for t in trajectories], cfg.mini_batches)
        for _ in range(cfg.ppo_epochs):
            for mini in minis:
                plan = [[mini[j] for j in mb] for mb in rank_plan([lengths[i] for i in mini], cfg.micro_batch_tokens,
                                                                    self.world_size, self.rank)]
                num_tokens = float(sum(sum(trajectories[i].loss_mask) for i in mini))
                self.optimizer.zero_grad(set_to_none=True)
                for mb in self._micro_batches(trajectories, plan, returns):  # returns ride in .advantages
                    v, target, old = self._values(mb), mb.advantages, to_grid(mb, old_values)
                    err = (v - target) ** 2
                    if eps > 0:
                        err_clipped = (old + (v - old).clamp(-eps, eps) - target) ** 2
                        clipped = (err_clipped > err).float()
                        err = torch.maximum(err, err_clipped)
                    else:
                        clipped = torch.zeros_like(err)
                    loss = aggregate(0.5 * err, mb.loss_mask, num_tokens=num_tokens)
                    (loss * self.world_size).backward()
                    totals["value_loss"] += float(loss.detach())
                    totals["value_clipfrac"] += float(aggregate(clipped, mb.loss_mask, num_tokens=num_tokens))
                grad_norms.append(self._clip_and_step())
        stacked = torch.tensor([totals["value_loss"], totals["value_clipfrac"]], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(stacked)
        n = len(grad_norms)
        return {"value_loss": float(stacked[0]) / n, "value_clipfrac": float(stacked[1]) / n,
                "value_grad_norm": sum(grad_norms) / n}

    def _clip_and_step(self) -> float:
        params = list(self.model.parameters())
        grad_norm = clip_and_step(self.optimizer, params, local_grad_norm(params), self.train_cfg.grad_clip)
        self.step += 1
        return grad_norm

    def save_checkpoint(self, path: Path) -> None:
        ckpt.save(Path(path), self.model, self.optimizer, self.rank, {"step": self.step})

    def load_checkpoint(self, path: Path) -> None:
        meta: dict[str, Any] = ckpt.load(Path(path), self.model, self.optimizer, self.rank)
        self.step = int(meta.get("step", 0))

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False


def build_critic(model: nn.Module, tokenizer: Any, train: TrainConfig, algo: AlgoConfig, *,
                 device: str = "cpu") -> CriticTrainer:
    """The ``value-head`` critic (entry point of ``miles_agent.critics``): the policy's backbone with a
    scalar head, sharded like the policy."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CriticTrainer(ValueModel(model), train, algo, pad_id=pad, device=device)
