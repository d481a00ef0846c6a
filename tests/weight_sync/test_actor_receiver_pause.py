"""The rank-0 path's receiver for engine actors (runtime/rank0_sync.ActorReceiver) carries a push's pause in
its first bucket's announcement instead of a Ray call of its own, and the engine actor pauses before that
bucket touches a weight. Against a fake actor handle that records the calls as Ray would deliver them."""

from __future__ import annotations

import asyncio

from miles_agent.runtime.rank0_sync import ActorReceiver


class _Method:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args):  # noqa: ANN201 - an awaitable, as an ObjectRef is
        self.calls.append((self.name, args))
        return asyncio.sleep(0)


class _Actor:
    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.calls, name)


def test_the_pause_rides_on_the_first_announcement_and_only_there():
    actor = _Actor()
    receiver = ActorReceiver(actor)

    async def push() -> None:
        await receiver.pause_generation("in_place")
        assert actor.calls == []  # no round trip of its own
        for _ in range(3):
            await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g")
        await receiver.continue_generation()
        await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g")  # next push

    asyncio.run(push())
    announced = [args for name, args in actor.calls if name == "update_weights_from_distributed"]
    assert [a[-2] for a in announced] == [0, 1, 2, 3]  # bucket numbers
    assert [a[-1] for a in announced] == ["in_place", None, None, None]  # the pause, on the first only
    assert [name for name, _ in actor.calls].count("continue_generation") == 1


def test_the_engine_actor_pauses_before_the_bucket_it_came_with():
    from miles_agent.runtime import engine_actor

    order: list[str] = []

    class Receiver:
        async def pause_generation(self, mode: str) -> None:
            order.append(f"pause {mode}")

        async def update_weights_from_distributed(self, *args, bucket=None) -> None:
            order.append(f"bucket {bucket}")

    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)
    actor.receiver = Receiver()
    asyncio.run(actor.update_weights_from_distributed(["w"], ["float32"], [[2]], "g", True, None, None, 0,
                                                      "in_place"))
    asyncio.run(actor.update_weights_from_distributed(["w"], ["float32"], [[2]], "g", True, None, None, 1))
    assert order == ["pause in_place", "bucket 0", "bucket 1"]
