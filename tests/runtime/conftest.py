"""One Ray instance for every runtime test: local, loopback only, no dashboard, 4 fake GPUs.

The GPUs are logical resources only (nothing here runs on them): they let placement tests check
which bundle and device each actor was given, on any machine.
"""

from __future__ import annotations

import asyncio
import os

import pytest

FAKE_GPUS = 4


@pytest.fixture(scope="session")
def ray_session():
    from miles_agent.runtime.ray_cluster import loopback_only

    loopback_only()  # before ray is imported
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    for attempt in range(2):  # Ray gives its raylet a fixed 30 s to register; a busy machine can miss it once
        try:
            ray.init(address="local", include_dashboard=False, num_cpus=16, num_gpus=FAKE_GPUS, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    yield ray
    ray.shutdown()


def train_then_close(run) -> tuple[list[dict], list]:
    """Train ``run`` on its config, always shutting its engines and trainer down; the records and the
    trainer group's memory log (what was offloaded and reloaded, in order)."""
    async def main():
        try:
            return await run.train(), run.trainer.memory_log()[0]
        finally:
            await run.engine.shutdown()
            run.trainer.close()

    return asyncio.run(main())
