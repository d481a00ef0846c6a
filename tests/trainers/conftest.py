"""Trainers built in the test process join a torch.distributed group (world size 1, gloo) that some tests
never close; later tests (e.g. the Megatron ones, which build their own groups) need none left behind."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
