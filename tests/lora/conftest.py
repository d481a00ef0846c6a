"""LoRA tests build FSDP2 trainers (a one-rank gloo group each): none may outlive its test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
