"""RoutingCapture: routed experts reach multi-turn trajectories without the harness knowing; each row is
the one the engine used when the token first went through the model; each episode attempt holds only its
own calls, about one row per token, and frees them when it ends."""

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
    recorder = capture.episode()
    traj = Trajectory(prompt_ids=[1, 2, 3])

    async def episode():
        c = await recorder.generate(traj.tokens, SamplingParams())
        assert c.routed_experts is None  # the harness did not ask: it gets what it asked for
        traj.append_model(c.output_ids, c.output_logprobs, 0, turn=0)
        traj.append_observation([4, 5], turn=0)
        c = await recorder.generate(traj.tokens, SamplingParams(), return_routed_experts=True)
        assert c.routed_experts is not None
        traj.append_model(c.output_ids, c.output_logprobs, 0, turn=1)
        traj.append_observation([6], turn=1)  # a final observation: never went through the model

    asyncio.run(episode())
    assert policy.asked == [True, True]
    # Call 1 continues call 0: it keeps only rows 4.. (tokens 8 4 5); rows 0..3 are call 0's.
    assert [len(c.routed) for c in recorder.calls] == [4, 3] and capture.stored_calls == 2
    traj.reward = 1.0
    assert recorder.attach([traj]) == 0
    re = traj.validate().routed_experts
    assert re.shape == (len(traj.tokens) - 1, 1, 2) == (8, 1, 2)
    # Call 0 ran [1,2,3,7] (rows 0..3: the routing that sampled 7 and 8); call 1 ran the whole history
    # again and [8,4,5] for the first time (rows 4..6: what sampled 9); token 9 was never routed.
    assert re[:7, 0, 0].tolist() == [0, 1, 2, 3, 104, 105, 106]
    assert re[7].tolist() == [[-1, -1]]
    assert capture.stored_calls == 0  # attached: the attempt holds nothing any more


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


def _turn(recorder, traj, turn, observation=None):
    async def go():
        c = await recorder.generate(list(traj.tokens), SamplingParams())
        traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn,
                          version_starts=c.meta.get("weight_versions"))
        if observation:
            traj.append_observation(observation, turn)
    asyncio.run(go())


def test_an_episode_across_a_weight_update_keeps_the_routing_that_sampled_each_turn():
    """Turn 0 on version 0, cut by an update (keep: its last tokens on version 1), turn 1 on version 1.
    The rows of turn 0 are call 0's (both versions, as the engine ran them), not call 1's re-run."""
    policy = VersionedPolicy([[7, 8, 9], [10, 11]])
    recorder = RoutingCapture(policy).episode()
    traj = Trajectory(prompt_ids=[1, 2])
    policy.cut = 2
    _turn(recorder, traj, 0, observation=[4])
    _turn(recorder, traj, 1)
    assert traj.weight_versions == [0, 1, 1]
    traj.reward = 0.0
    assert recorder.attach([traj]) == 0
    rows = traj.validate().routed_experts[:, 0].tolist()
    # tokens 1 2 | 7 8 9 | 4 | 10 11 -- rows 0..3 (tokens 1 2 7 8) run by call 0: token 8 went through the
    # model after the cut, on v1; rows 4..6 (tokens 9 4 10) first run by call 1, on v1
    assert rows == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1], [1, 1], [1, 1]]


def test_each_attempt_holds_only_its_own_calls_until_it_ends():
    """One-step-off / async: the next batch's episodes are mid-flight when one episode is attached."""
    policy = VersionedPolicy([[7], [8], [9], [7]])
    capture = RoutingCapture(policy)
    done, in_flight, abandoned = capture.episode(), capture.episode(), capture.episode()
    a, b, c = Trajectory(prompt_ids=[1]), Trajectory(prompt_ids=[2]), Trajectory(prompt_ids=[3])
    _turn(abandoned, c, 0)  # e.g. preempted: never attached
    _turn(done, a, 0)
    _turn(in_flight, b, 0)
    a.reward = 0.0
    assert capture.stored_calls == 3
    assert done.attach([a]) == 0 and a.routed_experts[:, 0].tolist() == [[0, 1]]
    abandoned.discard()
    assert capture.stored_calls == 1
    _turn(in_flight, b, 1)  # the in-flight episode goes on; its first call is still there
    assert in_flight.attach([b]) == 0
    assert b.routed_experts[:, 0].tolist() == [[0, 2], [0, 3]]  # token 2 by call 2, token 9 by call 3
    assert capture.stored_calls == 0
    stranger = Trajectory(prompt_ids=[3])  # the abandoned attempt's tokens: its calls are gone
    stranger.append_model([9], [-0.1], 0, turn=0)
    assert done.attach([stranger]) == 1 and stranger.metadata["routing_missing"]
    assert (stranger.routed_experts == -1).all() and stranger.routed_experts.shape == (1, 1, 2)


def test_a_long_episode_holds_about_one_row_per_token():
    turns, out = 20, [7, 8, 9]
    recorder = RoutingCapture(VersionedPolicy([out] * turns)).episode()
    traj = Trajectory(prompt_ids=[1, 2, 3])
    for k in range(turns):
        _turn(recorder, traj, k, observation=[4, 5])
    held = sum(len(c.routed) for c in recorder.calls)
    assert held == len(traj.tokens) - 3  # not ~turns x tokens / 2: each call keeps only its new rows ...
    assert all(c.routed.base is None for c in recorder.calls[1:])  # ... in arrays of their own
    traj.reward = 0.0
    assert recorder.attach([traj]) == 0
    first_call = traj.routed_experts[:, 0, 1]
    starts = [3 + 5 * k for k in range(turns)]  # where each call's sampled tokens begin
    assert first_call[: starts[0] + 2].tolist() == [0] * 5
    assert all((first_call[s - 2:s + 2] == k).all() for k, s in enumerate(starts[1:], start=1))


def test_a_trajectory_no_call_produced_is_flagged_and_a_relabelled_turn_still_gets_its_rows():
    recorder = RoutingCapture(VersionedPolicy([[7], [9]])).episode()
    traj = Trajectory(prompt_ids=[1])
    _turn(recorder, traj, 0, observation=[4])
    _turn(recorder, traj, 1)
    edited = Trajectory(prompt_ids=[1])  # the harness rewrote turn 0: no call sampled these tokens
    edited.append_model([6], [-0.1], 0, turn=0)
    edited.append_observation([4], turn=0)
    edited.append_model([9], [-0.1], 0, turn=1)
    relabelled = Trajectory(prompt_ids=[1])  # turn 0 kept, but as context (not trained on)
    relabelled.append_observation([7, 4], turn=0)
    relabelled.append_model([9], [-0.1], 0, turn=1)
    relabelled.reward = edited.reward = 0.0
    assert recorder.attach([edited, relabelled]) == 1
    assert edited.metadata["routing_missing"] and (edited.routed_experts == -1).all()
    # the last call continued call 0, so token 1 keeps call 0's row, tokens 7 and 4 call 1's
    assert relabelled.validate().routed_experts[:, 0].tolist() == [[0, 0], [0, 1], [0, 1]]
