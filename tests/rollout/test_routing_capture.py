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


def test_capture_attaches_the_last_calls_routing_to_each_trajectory():
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
    # call 2 saw [1,2,3,7,8,4,5] and sampled 9: rows 0..6 are its routing, row 7 (token 9) was never routed
    assert re[:7, 0, 0].tolist() == [100 + i for i in range(7)]
    assert re[7].tolist() == [[-1, -1]]


def test_a_trajectory_without_a_recorded_call_is_flagged():
    capture = RoutingCapture(RoutingPolicy([[7]]))
    asyncio.run(capture.generate([1, 2], SamplingParams()))
    other = Trajectory(prompt_ids=[5, 6])
    other.append_model([9], [-0.1], 0, turn=0)
    assert capture.attach([other]) == 1
    assert other.metadata["routing_missing"] and (other.routed_experts == -1).all()
