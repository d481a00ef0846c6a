"""RoutingCapture: routed experts reach multi-turn trajectories without the harness knowing."""

from __future__ import annotations

import asyncio

import numpy as np

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.rollout.routing_capture import RoutingCapture
from miles_agent.types import Trajectory


class RoutingPolicy:
    """Replies with fixed ids; routing row i of a call is [[100*call + i, i]] (1 layer, top-2)."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies, self.asked, self.calls = list(replies), [], 0

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        self.asked.append(return_routed_experts)
        out = self.replies.pop(0)
        n = len(input_ids) + len(out) - 1
        routed = np.array([[[100 * self.calls + i, i]] for i in range(n)], dtype=np.int32)
        self.calls += 1
        return Completion(out, [-0.5] * len(out), FinishReason.STOP, 0, len(input_ids),
                          routed if return_routed_experts else None)


def test_each_row_comes_from_the_call_that_first_ran_its_token():
    policy = RoutingPolicy([[7, 8], [9]])
    capture = RoutingCapture(policy)
    traj = Trajectory(prompt_ids=[1, 2, 3])

    async def episode():
        c = await capture.generate(traj.tokens, SamplingParams())
        assert c.routed_experts is None  # the harness did not ask: it gets what it asked for
        traj.append_model(c.output_ids, c.output_logprobs, 0, turn=0)
        traj.append_observation([4, 5], turn=0)
        c = await capture.generate(traj.tokens, SamplingParams(), return_routed_experts=True)
        assert c.routed_experts is not None
        traj.append_model(c.output_ids, c.output_logprobs, 0, turn=1)
        traj.append_observation([6], turn=1)  # a final observation: never went through the model

    asyncio.run(episode())
    assert policy.asked == [True, True]
    traj.reward = 1.0
    assert capture.attach([traj]) == 0
    re = traj.validate().routed_experts
    assert re.shape == (len(traj.tokens) - 1, 1, 2) == (8, 1, 2)
    # Call 0 ran [1,2,3,7] (rows 0..3: the routing that sampled 7 and 8); call 1 ran the whole history
    # again and [8,4,5] for the first time (rows 4..6: what sampled 9); token 9 was never routed.
    assert re[:7, 0, 0].tolist() == [0, 1, 2, 3, 104, 105, 106]
    assert re[7].tolist() == [[-1, -1]]
    assert capture.stored_calls == 0  # both calls were consumed


def test_a_trajectory_without_a_recorded_call_is_flagged():
    capture = RoutingCapture(RoutingPolicy([[7]]))
    asyncio.run(capture.generate([1, 2], SamplingParams()))
    other = Trajectory(prompt_ids=[5, 6])
    other.append_model([9], [-0.1], 0, turn=0)
    assert capture.attach([other]) == 1
    assert other.metadata["routing_missing"] and (other.routed_experts == -1).all()


class VersionedPolicy:
    """Replies with fixed ids at a settable weight version; every routing row of a call is
    [[version, call]], so a test can tell which call and which weights a row came from."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies, self.version, self.calls = list(replies), 0, 0
        self.cut: int | None = None  # the weights change after this many output tokens of the next call

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        out = self.replies.pop(0)
        rows = np.array([[[self.version, self.calls]]] * (len(input_ids) + len(out) - 1), dtype=np.int32)
        meta = {}
        if self.cut is not None:  # partial_rollout=keep: the old rows stay, the rest on the new version
            meta["weight_versions"] = [(self.version, 0), (self.version + 1, self.cut)]
            rows[len(input_ids) - 1 + self.cut:, 0, 0] = self.version + 1
            self.version, self.cut = self.version + 1, None
        self.calls += 1
        return Completion(out, [-0.5] * len(out), FinishReason.STOP, self.version, len(input_ids), rows, meta)


def _turn(capture, traj, turn, observation=None):
    async def go():
        c = await capture.generate(list(traj.tokens), SamplingParams())
        traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn,
                          version_starts=c.meta.get("weight_versions"))
        if observation:
            traj.append_observation(observation, turn)
    asyncio.run(go())


def test_an_episode_across_a_weight_update_keeps_the_routing_that_sampled_each_turn():
    """Turn 0 on version 0, cut by an update (keep: its last tokens on version 1), turn 1 on version 1.
    The rows of turn 0 are call 0's (both versions, as the engine ran them), not call 1's re-run."""
    policy = VersionedPolicy([[7, 8, 9], [10, 11]])
    capture = RoutingCapture(policy)
    traj = Trajectory(prompt_ids=[1, 2])
    policy.cut = 2
    _turn(capture, traj, 0, observation=[4])
    _turn(capture, traj, 1)
    assert traj.weight_versions == [0, 1, 1]
    traj.reward = 0.0
    assert capture.attach([traj]) == 0
    rows = traj.validate().routed_experts[:, 0].tolist()
    # tokens 1 2 | 7 8 9 | 4 | 10 11 -- rows 0..3 (tokens 1 2 7 8) run by call 0: token 8 went through the
    # model after the cut, on v1; rows 4..6 (tokens 9 4 10) first run by call 1, on v1
    assert rows == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]]


def test_attach_keeps_other_episodes_calls_and_forgets_by_version():
    """One-step-off / async: the next batch's episodes are mid-flight when this one is attached."""
    policy = VersionedPolicy([[7], [8], [9]])
    capture = RoutingCapture(policy)
    done, in_flight, abandoned = Trajectory(prompt_ids=[1]), Trajectory(prompt_ids=[2]), Trajectory(prompt_ids=[3])
    _turn(capture, abandoned, 0)  # an attempt recycled or preempted: never attached
    policy.version = 1
    _turn(capture, done, 0)
    _turn(capture, in_flight, 0)
    done.reward = 0.0
    assert capture.attach([done]) == 0 and capture.stored_calls == 2
    capture.forget_older_than(1)  # e.g. trainer at version 2 with max_staleness=1
    assert capture.stored_calls == 1
    assert capture.attach([in_flight]) == 0 and in_flight.routed_experts[:, 0].tolist() == [[1, 2]]
    assert capture.attach([abandoned]) == 1 and abandoned.metadata["routing_missing"]
    assert capture.stored_calls == 0


def test_two_calls_that_drew_the_same_tokens_each_serve_one_trajectory():
    policy = VersionedPolicy([[7], [7], [7]])
    capture = RoutingCapture(policy)
    a, b, c = (Trajectory(prompt_ids=[1]) for _ in range(3))
    _turn(capture, a, 0)
    policy.version = 1
    _turn(capture, b, 0)
    _turn(capture, c, 0)
    assert capture.attach([b, a]) == 0  # b: a version-1 call; a: the version-0 one
    assert b.routed_experts[:, 0].tolist() == [[1, 1]] and a.routed_experts[:, 0].tolist() == [[0, 0]]
    assert capture.attach([c]) == 0 and c.routed_experts[:, 0].tolist() == [[1, 2]]


def test_missing_routing_still_gets_rows_after_the_store_emptied():
    capture = RoutingCapture(VersionedPolicy([[7]]))
    t = Trajectory(prompt_ids=[1])
    _turn(capture, t, 0)
    t.reward = 0.0
    capture.attach([t])
    late = Trajectory(prompt_ids=[5, 6])
    late.append_model([9], [-0.1], 0, turn=0)
    assert capture.attach([late]) == 1 and late.routed_experts.shape == (2, 1, 2)
    assert (late.routed_experts == -1).all()
