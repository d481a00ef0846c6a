"""Checkpoints and HF export for an FSDP2-sharded model; collectives, so every rank calls them.

Training checkpoints use torch.distributed.checkpoint (DCP): each rank writes its own shards, so
no rank ever holds the full model and optimizer, and a checkpoint can be re-loaded at another
world size. RNG states are per rank (``rng_rank{r}.pt``). Everything is written to ``<path>.tmp``
and renamed into place only when every rank has finished, so a crash mid-save never leaves a
half-written checkpoint under the real name (NeMo-RL #3599). With several nodes ``path`` must be on
a shared filesystem.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from miles_agent.atomic import replace_dir
from miles_agent.errors import UserError

META = "meta.json"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])



def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
         meta: dict[str, Any]) -> None:
    """Model + optimizer (DCP shards), per-rank RNG and ``meta`` (JSON), atomically at ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        (tmp / META).write_text(json.dumps({**meta, "world_size": dist.get_world_size()}))
    dist.barrier()
    if rank == 0:
        replace_dir(tmp, path)
    dist.barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any]:
    """Restore what :func:`save` wrote (resharding if the world size changed); returns its meta.

    RNG state is restored only when the checkpoint has a file for this rank."""
    if not (path / META).is_file():
        raise UserError(f"{path} is not a trainer checkpoint (no {META}); pass a folder written by "
                        "save_checkpoint")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a truncated shard: whatever the reader trips on
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
        raise UserError(f"trainer checkpoint {path} cannot be read ({last[0].strip()[:200]}); a shard "
                        "is truncated or corrupt -- delete this step's folder to resume from an earlier one") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = path / f"rng_rank{rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    dist.barrier()
    return json.loads((path / META).read_text())


def save_hf(model: nn.Module, tokenizer: Any, path: Path, rank: int, dtype: torch.dtype | None = None) -> None:
    """Gather full weights to rank 0 (CPU) and write an HF folder via ``models.builder.save_hf``, in
    ``dtype`` (the model's compute dtype; None: as held).

    The weights are loaded into an HF model built on the meta device, so rank 0 holds one full copy
    of the weights and no second, randomly initialized model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from miles_agent.models.builder import save_hf as write_hf

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    if rank == 0:
        with torch.device("meta"):
            vision = getattr(model.config, "vision_config", None) is not None  # a vision-language model
            shell = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(model.config)
        shell.load_state_dict(full, assign=True, strict=True)
        shell.tie_weights()
        shell.generation_config = model.generation_config
        write_hf(shell, tokenizer, path)
    dist.barrier()
