"""A server that dies mid-request (the episode is retried and counted, never scored), and routed experts
(R3) decoded from SGLang's base64 payload."""

from __future__ import annotations

import asyncio
import base64
import functools

import numpy as np
import pytest

from miles_agent.build import build_env, build_harness
from miles_agent.config import load_config
from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.engines.sglang.wire import (
    GenerateResponseError,
    decode_routed_experts,
    encode_routed_experts,
)
from miles_agent.models.builder import build_tiny
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.types import Status

PROMPT = [5, 17, 42, 99, 3, 7]


@functools.cache
def tiny(arch: str):
    return build_tiny(arch)


def test_engine_dying_mid_request_aborts_and_the_episode_is_retried_elsewhere(start_fake, dense_server):
    """Two servers; the one serving the episode's first attempt dies mid-request. The request aborts with
    the reason, the episode is retried (on the live server) and counted; nothing is scored 0."""
    server = start_fake("tiny-qwen3", "--decode-delay-s", "0.02")
    cfg = load_config("tiny-cpu", ["env.name=arith-tools", "env.max_new_tokens_per_turn=8"])
    env = build_env(cfg)
    _, tok = tiny("tiny-qwen3")
    runner = EpisodeRunner(env, build_harness(cfg, env, tok), max_retries=2)
    task = env.tasks("train")[0]
    doomed = SGLangEngine(server.url)
    policy = SGLangEngine(server.url, generate_urls=[server.url, dense_server.url])

    async def main():
        try:
            assert await doomed.health()
            await doomed.pause(PauseMode.IN_PLACE)  # requests queue in the server: they are in flight
            direct = asyncio.ensure_future(doomed.generate(PROMPT, SamplingParams(max_new_tokens=8)))
            episode = asyncio.ensure_future(runner.run(task, policy, "g0"))  # round-robin: the doomed server
            while server.state()["waiting"] < 2:
                await asyncio.sleep(0.01)
            server.kill()
            return await direct, await episode, await doomed.health()
        finally:
            await doomed.shutdown()
            await policy.shutdown()
    direct, trajs, healthy = asyncio.run(main())
    assert direct.finish_reason is FinishReason.ABORT and direct.output_ids == []
    assert "failed mid-request" in direct.meta["error"]
    assert not healthy
    assert all(t.status is not Status.FAILED and t.status is not Status.ABORTED for t in trajs)
    assert all(t.metadata["attempts"] == 2 for t in trajs)
    assert runner.stats.retries == 1 and runner.stats.failed == 0
    assert policy.stats["engine_errors"] == 1 and policy._down == {server.url}

    # with no live server left, every attempt aborts: the episode comes back FAILED and counted, unscored
    alone = SGLangEngine(server.url)
    runner2 = EpisodeRunner(env, build_harness(cfg, env, tok), max_retries=2)

    async def again():
        try:
            return await runner2.run(task, alone, "g1")
        finally:
            await alone.shutdown()
    trajs = asyncio.run(again())
    # out of retries on an infrastructure failure: aborted (not the task's fault), never scored
    assert [t.status for t in trajs] == [Status.ABORTED] and trajs[0].reward is None
    assert runner2.stats.retries == 3 and runner2.stats.aborted == 1 and runner2.stats.failed == 0
    assert runner2.stats.errors == [f"{task.id}: generation aborted"]
    assert alone.stats["engine_errors"] == 3


def test_server_error_status_aborts_the_request(dense_server):
    """A 5xx (or any non-400 error) is the engine's failure: the request aborts, the caller retries."""
    client = SGLangEngine(dense_server.url, generate_urls=[f"{dense_server.url}/no_such_prefix"])  # a 404

    async def main():
        try:
            return await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
        finally:
            await client.shutdown()
    c = asyncio.run(main())
    assert c.finish_reason is FinishReason.ABORT and "HTTP 404" in c.meta["error"]


def test_routed_experts_from_http_equal_the_engines_own(start_fake):
    server = start_fake("tiny-qwen3-moe", "--ignore-eos")
    model, tok = tiny("tiny-qwen3-moe")
    sampling = SamplingParams(max_new_tokens=5, temperature=0)
    engine = EmbeddedEngine(model, tok, max_batch_size=2)
    engine.eos_ids = frozenset()
    client = SGLangEngine(server.url, routed_top_k=model.config.num_experts_per_tok)

    async def main():
        try:
            return (await engine.generate(PROMPT, sampling, return_routed_experts=True),
                    await client.generate(PROMPT, sampling, return_routed_experts=True))
        finally:
            await engine.shutdown()
            await client.shutdown()
    ref, got = asyncio.run(main())
    moe_layers = len(engine.runner.moe_layers)
    assert got.output_ids == ref.output_ids
    assert got.routed_experts.dtype == np.int32
    assert got.routed_experts.shape == (len(PROMPT) + 5 - 1, moe_layers, model.config.num_experts_per_tok)
    np.testing.assert_array_equal(got.routed_experts, ref.routed_experts)
    assert ((got.routed_experts >= 0) & (got.routed_experts < model.config.num_experts)).all()


def test_routed_experts_decoding_exactly():
    rng = np.random.default_rng(0)
    routed = rng.integers(0, 64, size=(9, 3, 2), dtype=np.int32)
    data = encode_routed_experts(routed)
    assert base64.b64decode(data) == routed.tobytes()  # SGLang's bytes: int32, C order, no header
    for kw in ({"top_k": 2}, {"layers": 3}, {"top_k": 2, "layers": 3}):
        out = decode_routed_experts(data, rows=9, **kw)
        assert out.dtype == np.int32 and out.shape == (9, 3, 2)
        np.testing.assert_array_equal(out, routed)
    assert out.flags.writeable  # a copy, not a view of the decoded bytes
    with pytest.raises(GenerateResponseError, match="not a multiple"):
        decode_routed_experts(data, rows=8, top_k=2)
    with pytest.raises(GenerateResponseError, match="layers x top_k"):
        decode_routed_experts(data, rows=9, top_k=4)


def test_routed_experts_decoded_from_generate_replay_in_the_trainer(start_fake):
    """R3 end to end over HTTP: the ids SGLang's /generate returns drive the FSDP2 trainer's routers."""
    import torch

    from miles_agent.config import AlgoConfig, TrainConfig
    from miles_agent.trainers import routing_replay
    from miles_agent.trainers.fsdp2 import FSDP2Trainer
    from miles_agent.types import Trajectory

    server = start_fake("tiny-qwen3-moe", "--ignore-eos")
    model, tok = tiny("tiny-qwen3-moe")
    client = SGLangEngine(server.url, routed_top_k=model.config.num_experts_per_tok)

    async def sample():
        try:
            return await client.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
                                         return_routed_experts=True)
        finally:
            await client.shutdown()
    out = asyncio.run(sample())
    traj = Trajectory(prompt_ids=list(PROMPT))
    traj.append_model(list(out.output_ids), list(out.output_logprobs), weight_version=out.weight_version, turn=0)
    traj.routed_experts = out.routed_experts
    traj.reward = 1.0
    traj.validate()

    import copy

    trainer = FSDP2Trainer(copy.deepcopy(model), tok, TrainConfig(), AlgoConfig(routing_replay=True))
    try:
        used = []
        hooks = [r.register_forward_hook(lambda m, a, o: used.append(o[2].clone()))
                 for r in routing_replay.moe_routers(trainer.model)]
        (logps,) = trainer.compute_logprobs([traj])
        for h in hooks:
            h.remove()
    finally:
        trainer.close()
    used_ids = torch.stack(used, dim=1)[: len(traj.tokens) - 1]  # [positions, layers, top_k]
    # each token is routed to exactly the experts the server reported, whatever its order within top-k
    assert torch.equal(used_ids.sort(-1).values, torch.from_numpy(out.routed_experts).long().sort(-1).values)
    assert logps == pytest.approx(out.output_logprobs, abs=1e-4)
