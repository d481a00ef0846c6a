"""The rank-0 path's receiver for engine actors (runtime/rank0_sync.ActorReceiver) carries a push's pause in
its first bucket's announcement and its resume in the last one, instead of Ray calls of their own; the engine
actor pauses before the first bucket touches a weight and resumes only once every bucket has loaded. Against a
fake actor handle that records the calls as Ray would deliver them, and the distributed transport with its
broadcasts stubbed."""

from __future__ import annotations

import asyncio

from miles_agent.runtime.rank0_sync import ActorReceiver


class _Method:
    def __init__(self, calls: list, name: str, fails: bool) -> None:
        self.calls, self.name, self.fails = calls, name, fails

    def remote(self, *args):  # noqa: ANN201 - an awaitable, as an ObjectRef is
        self.calls.append((self.name, args))
        return _fail() if self.fails else asyncio.sleep(0)


async def _fail() -> None:
    raise RuntimeError("the actor died")


class _Actor:
    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.calls: list = []
        self.failing = failing

    def __getattr__(self, name: str) -> _Method:  # only for names __init__ did not set
        return _Method(self.calls, name, name in self.failing)


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
    assert [a[-3] for a in announced] == [0, 1, 2, 3]  # bucket numbers
    assert [a[-2] for a in announced] == ["in_place", None, None, None]  # the pause, on the first only
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


def test_a_resume_carried_by_the_last_announcement_saves_the_continue_call():
    actor = _Actor()
    receiver = ActorReceiver(actor)

    async def push() -> None:
        await receiver.pause_generation("in_place")
        await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g")
        await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", resume=True)
        await receiver.continue_generation()
        await receiver.pause_generation("in_place")  # the next push, whose last bucket did not resume
        await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g")
        await receiver.continue_generation()

    asyncio.run(push())
    announced = [args for name, args in actor.calls if name == "update_weights_from_distributed"]
    assert [a[-1] for a in announced] == [False, True, False]
    assert [name for name, _ in actor.calls].count("continue_generation") == 1  # the second push's only


def test_when_the_resuming_announcement_fails_continue_still_calls():
    actor = _Actor(failing=frozenset({"update_weights_from_distributed"}))
    receiver = ActorReceiver(actor)

    async def push() -> None:
        await receiver.pause_generation("in_place")
        try:
            await receiver.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", resume=True)
        except RuntimeError:
            pass
        await receiver.continue_generation()  # what the transport's push does in its finally

    asyncio.run(push())
    assert [name for name, _ in actor.calls].count("continue_generation") == 1


def test_the_engine_actor_resumes_only_once_every_bucket_has_loaded(monkeypatch):
    """Bucket 0's load is slow (queued behind a step); bucket 1, the last, carries the resume and finishes its
    own load first: the actor must still wait for bucket 0 before it resumes."""
    import threading

    import torch

    from miles_agent.runtime import engine_actor
    from miles_agent.transports.receiver import InProcessReceiver, ModelHolder

    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src, group: None)
    order: list[str] = []

    class SlowFirstLoad(ModelHolder):
        loads = 0

        async def update_weights(self, named_tensors, version) -> None:  # noqa: ANN001
            self.loads += 1
            if self.loads == 1:  # bucket 0's
                await asyncio.sleep(0.2)
            order.append("load")

        async def resume(self) -> None:
            order.append("resume")

    model = torch.nn.Sequential(torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(3, 1, bias=False))
    rx = InProcessReceiver(SlowFirstLoad(model))
    rx._groups["g"] = threading.Lock()
    rx._next_bucket["g"] = rx._arrived["g"] = 0
    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)
    actor.receiver = rx

    async def main() -> None:
        first = asyncio.create_task(actor.update_weights_from_distributed(
            ["0.weight"], ["float32"], [[1, 2]], "g", True, None, None, 0, "in_place"))
        await asyncio.sleep(0.01)  # bucket 0 is in its slow load when the last bucket arrives
        await actor.update_weights_from_distributed(["1.weight"], ["float32"], [[1, 3]], "g", True, None, None, 1,
                                                    None, True)
        assert first.done()  # the resume waited for bucket 0's load
        await first

    asyncio.run(main())
    assert order == ["load", "load", "resume"]


def _announcements(check: bool, monkeypatch, buckets: int = 3) -> list[bool]:
    """A push of ``buckets`` buckets through the distributed transport (broadcasts stubbed): each announcement's
    resume flag, as a receiver that can carry it sees them."""
    import torch

    from miles_agent.transports import dist

    monkeypatch.setattr(dist, "_broadcast_all", lambda tensors, group: None)
    seen: list[bool] = []
    events: list[str] = []

    class Recorder:
        resumes_after_last_bucket = True

        async def pause_generation(self, mode: str = "in_place") -> None: ...

        async def continue_generation(self) -> None: ...

        def update_weights_from_distributed(self, names, dtypes, shapes, resume=False, **kw):  # noqa: ANN001, ANN201
            seen.append(resume)  # recorded when the transport announces (a Ray call is sent then)
            events.append(f"announce {names[0]}")
            return asyncio.sleep(0)

        async def check_weights(self, action: str = "checksum") -> dict:
            return {"checksums": expected}

    weights = [(f"w{i}", torch.full((256,), float(i))) for i in range(buckets)]  # 1 KiB each: a bucket each
    from miles_agent.transports.core import tensor_checksum

    expected = {name: tensor_checksum(t) for name, t in weights}
    transport = dist.DistributedTransport([Recorder()], bucket_bytes=1024, check=check)
    transport.group = object()  # formed: the stubbed broadcasts need no group

    def gathered():  # a trainer's lazy gather: record when each tensor is read
        for name, t in weights:
            events.append(f"read {name}")
            yield name, t

    asyncio.run(transport.push(gathered(), 1))
    if buckets == 3:  # bucket 0 is announced before bucket 2 is read, bucket 1 after (the bucketing itself reads
        # one tensor ahead, to know where a bucket ends)
        assert events == ["read w0", "read w1", "announce w0", "read w2", "announce w1", "announce w2"]
    return seen


def test_the_transport_marks_the_last_bucket_only_and_not_when_checking(monkeypatch):
    assert _announcements(check=False, monkeypatch=monkeypatch) == [False, False, True]
    assert _announcements(check=True, monkeypatch=monkeypatch) == [False, False, False]  # the check reads first
    assert _announcements(check=False, monkeypatch=monkeypatch, buckets=2) == [False, True]
    # bucket 0 goes out before the next is read: a push of one bucket resumes by a call of its own
    assert _announcements(check=False, monkeypatch=monkeypatch, buckets=1) == [False]


def test_a_streamed_push_carries_the_pause_and_the_resume_in_its_one_call():
    actor = _Actor()
    receiver = ActorReceiver(actor)

    async def push(resume: bool) -> None:
        await receiver.pause_generation("in_place")
        await receiver.receive_weights_stream("g", "3", resume=resume)
        await receiver.continue_generation()

    asyncio.run(push(resume=True))
    assert actor.calls == [("receive_weights_stream", ("g", "3", "in_place", True))]  # nothing after it
    actor.calls.clear()
    asyncio.run(push(resume=False))  # e.g. with the checksum check, which reads the weights before resuming
    assert actor.calls == [("receive_weights_stream", ("g", "3", "in_place", False)), ("continue_generation", ())]
