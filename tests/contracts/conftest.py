"""Contract suites (miles_agent/testing/contracts) run against every shipped plug-in that runs on CPU.

Trainers join a torch.distributed group; none is left behind for the next test. Tiny models: one
intra-op thread avoids OpenMP stalls on shared cores."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def one_torch_thread_and_no_group_left():
    import torch
    import torch.distributed as dist

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    if dist.is_initialized():
        dist.destroy_process_group()
