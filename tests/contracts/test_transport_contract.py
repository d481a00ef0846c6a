"""The weight-transport contract against every shipped transport (in-process, shared memory, distributed
gloo, disk) delivering to the embedded engine in another process (or in this one), and against transports
broken on purpose."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.embedded.process import EngineProcess, tiny_model_fn
from miles_agent.models.builder import build_tiny
from miles_agent.testing.contracts import WeightTransportContract
from miles_agent.testing.contracts.transport import ReceiverProbe
from miles_agent.transports import (
    DiskTransport,
    DistributedTransport,
    InProcessReceiver,
    InProcessTransport,
    SharedMemoryTransport,
)


@pytest.fixture(scope="module")
def engine_process():
    """One engine process (tiny-qwen3, seed 0), forked before this process starts any thread."""
    build_tiny("tiny-qwen3")
    with EngineProcess(tiny_model_fn(seed=0), start_method="fork", num_threads=1) as engine:
        yield engine


class TestInProcessTransport(WeightTransportContract):
    @pytest.fixture
    def make_transport(self):
        engine = EmbeddedEngine(*build_tiny("tiny-qwen3", seed=0))
        return lambda: (InProcessTransport([engine]), ReceiverProbe(InProcessReceiver(engine)))


class TestSharedMemoryTransport(WeightTransportContract):
    @pytest.fixture
    def make_transport(self, engine_process):
        return lambda: (SharedMemoryTransport([engine_process]), ReceiverProbe(engine_process))


class TestDistributedTransport(WeightTransportContract):
    @pytest.fixture(params=[False, True], ids=["per-tensor", "flat"])
    def make_transport(self, request, engine_process):
        return lambda: (DistributedTransport([engine_process], backend="gloo", flatten=request.param),
                        ReceiverProbe(engine_process))


class TestDiskTransport(WeightTransportContract):
    @pytest.fixture
    def make_transport(self, engine_process, tmp_path):
        return lambda: (DiskTransport([engine_process], root=tmp_path / "weights"), ReceiverProbe(engine_process))


class DropsATensor:
    def __init__(self, inner) -> None:
        self.inner = inner

    async def push(self, named_tensors, version):
        named = list(named_tensors)
        return await self.inner.push(named[:len(named) // 2] + named[len(named) // 2 + 1:], version)


class WrongVersion(DropsATensor):
    async def push(self, named_tensors, version):
        return await self.inner.push(named_tensors, version - 1)


def test_broken_transports_fail_the_contract():
    engine = EmbeddedEngine(*build_tiny("tiny-qwen3", seed=0))
    probe = ReceiverProbe(InProcessReceiver(engine))
    contract = WeightTransportContract()
    with pytest.raises(AssertionError, match="bit-exact"):
        contract.test_pushed_weights_arrive_bit_exact_with_the_version(
            lambda: (DropsATensor(InProcessTransport([engine])), probe))
    with pytest.raises(AssertionError, match="weight version"):
        contract.test_a_second_push_replaces_the_first(lambda: (WrongVersion(InProcessTransport([engine])), probe))
    asyncio.run(engine.shutdown())
