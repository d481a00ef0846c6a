"""Megatron-core on CPU: one gloo process group for the module, torn down after it (FSDP2 tests
in the same pytest process build their own group)."""

from __future__ import annotations

import socket
import warnings

import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def megatron_single_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state

    from miles_agent.trainers.megatron import cpu_compat

    warnings.filterwarnings("ignore", message="Apex is not installed")
    if dist.is_initialized():  # a group some earlier in-process test did not close: it owns nothing now
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cpu_compat.enable()
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
