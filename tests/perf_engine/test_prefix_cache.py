"""The embedded engine's prefix cache: an episode's next turn and a group's samples reuse cached KV, and
every guarantee of the uncached engine holds -- the same logprobs (bitwise in true on-policy mode), R3
routing rows for prompt tokens, no KV from old weights after an update, chunked prefill."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from miles_agent.engine import PauseMode, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.embedded.prefix_cache import PrefixCache
from miles_agent.models.builder import build_tiny

SEEDED = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def models():
    return {arch: build_tiny(arch) for arch in ("tiny-qwen3", "tiny-qwen3-moe")}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def engine_for(models, arch="tiny-qwen3", **kw) -> EmbeddedEngine:
    model, tok = models[arch]
    engine = EmbeddedEngine(copy.deepcopy(model), tok, **kw)
    engine.eos_ids = frozenset()  # fixed-length replies: the turns line up token for token
    return engine


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def episodes(engine: EmbeddedEngine, turns: int, n: int = 3, routed: bool = False,
             sampling: SamplingParams = SEEDED) -> list[list]:
    """n concurrent episodes; each turn resends the history + reply + 5 observation tokens."""
    async def main():
        hist, out = prompts(n, 20, seed=0), []
        for t in range(turns):
            comps = await asyncio.gather(*[engine.generate(h, sampling, return_routed_experts=routed)
                                           for h in hist])
            out.append(comps)
            obs = prompts(n, 5, seed=100 + t)
            hist = [h + c.output_ids + o for h, c, o in zip(hist, comps, obs)]
        return out

    return asyncio.run(main())


def flat(turns: list[list]) -> list:
    return [c for comps in turns for c in comps]


def test_later_turns_reuse_the_history_with_the_same_logprobs(models):
    cached, plain = engine_for(models), engine_for(models, prefix_cache_bytes=0)
    a, b = episodes(cached, 4), episodes(plain, 4)
    for x, y in zip(flat(a), flat(b)):
        assert x.output_ids == y.output_ids
        assert np.allclose(x.output_logprobs, y.output_logprobs, atol=1e-5, rtol=0)
    # turn t>0 recomputes only the reply's last token and the 5 observation tokens
    assert cached.stats["prefill_tokens"] == 3 * 20 + 3 * 3 * 6
    assert plain.stats["cached_tokens"] == 0 and plain.cache_hit_rate == 0
    # turn t's prompt is 20 + 17 t tokens (12 reply + 5 observation per turn), all but 6 cached
    assert cached.stats["cached_tokens"] == 3 * sum(20 + 17 * t - 6 for t in range(1, 4))
    assert 0.5 < cached.cache_hit_rate < 1


def test_a_groups_samples_compute_their_shared_prompt_once(models):
    cached, plain = engine_for(models), engine_for(models, prefix_cache_bytes=0)
    prompt = prompts(1, 40, seed=3)[0]

    def group(engine):
        async def main():
            return await asyncio.gather(*[engine.generate(prompt, SamplingParams(
                max_new_tokens=8, temperature=1.0, seed=s)) for s in range(6)])
        return asyncio.run(main())

    a, b = group(cached), group(plain)
    assert len({tuple(c.output_ids) for c in a}) > 1  # really different samples
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids
        assert np.allclose(x.output_logprobs, y.output_logprobs, atol=1e-5, rtol=0)
    assert cached.stats["prefill_tokens"] == 40 + 5 * 1  # each follower computes only the last prompt token
    assert plain.stats["prefill_tokens"] == 6 * 40


def test_true_on_policy_logprobs_stay_bitwise_equal(models):
    cached = engine_for(models, true_on_policy=True)
    plain = engine_for(models, true_on_policy=True, prefix_cache_bytes=0)
    a, b = episodes(cached, 3, n=2), episodes(plain, 3, n=2)
    assert cached.stats["cached_tokens"] > 0
    for x, y in zip(flat(a), flat(b)):
        assert x.output_ids == y.output_ids and x.output_logprobs == y.output_logprobs


def test_routing_rows_of_cached_prompt_tokens_are_returned(models):
    cached = engine_for(models, "tiny-qwen3-moe")
    plain = engine_for(models, "tiny-qwen3-moe", prefix_cache_bytes=0)
    a, b = episodes(cached, 3, routed=True), episodes(plain, 3, routed=True)
    assert cached.stats["cached_tokens"] > 0
    for x, y in zip(flat(a), flat(b)):
        n = x.prompt_tokens + len(x.output_ids) - 1
        assert x.routed_experts.shape[0] == n
        assert np.array_equal(x.routed_experts, y.routed_experts)


def test_a_prefix_cached_without_routing_is_not_reused_by_a_request_that_wants_it(models):
    engine = engine_for(models, "tiny-qwen3-moe")
    plain = engine_for(models, "tiny-qwen3-moe", prefix_cache_bytes=0)
    prompt = prompts(1, 30, seed=5)[0]

    async def main(e, routed):
        return await e.generate(prompt, SamplingParams(max_new_tokens=4, temperature=0),
                                return_routed_experts=routed)

    asyncio.run(main(engine, False))
    hits = engine.stats["cached_tokens"]
    with_rows = asyncio.run(main(engine, True))
    assert engine.stats["cached_tokens"] == hits  # recomputed: the cached prefix had no rows
    assert np.array_equal(with_rows.routed_experts, asyncio.run(main(plain, True)).routed_experts)
    asyncio.run(main(engine, True))
    assert engine.stats["cached_tokens"] == hits + 29  # now the rows are stored with the KV


def test_a_weight_update_drops_everything_the_old_weights_computed(models):
    engine = engine_for(models)
    prompt = prompts(1, 30, seed=9)[0]
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    new_weights = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in engine.model.named_parameters()]
    fresh = engine_for(models)
    asyncio.run(fresh.update_weights(new_weights, version=1))

    async def main():
        await engine.generate(prompt, greedy)
        assert engine.cache.tokens > 0
        await engine.update_weights(new_weights, version=1)
        assert engine.cache.tokens == 0
        hits = engine.stats["cached_tokens"]
        out = await engine.generate(prompt, greedy)
        assert engine.stats["cached_tokens"] == hits
        return out

    async def reference():
        return await fresh.generate(prompt, greedy)

    got, want = asyncio.run(main()), asyncio.run(reference())
    assert got.output_ids == want.output_ids
    assert np.allclose(got.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)


def test_a_request_that_outlives_an_update_in_place_is_not_cached(models):
    engine = engine_for(models)
    prompt = prompts(1, 25, seed=11)[0]
    weights = [(n, p.detach().clone()) for n, p in engine.model.named_parameters()]

    async def main():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=40, temperature=0)))
        while engine.stats["decode_steps"] < 3:
            await asyncio.sleep(0.001)
        await engine.pause(PauseMode.IN_PLACE)
        await engine.update_weights(weights, version=1)
        await engine.resume()
        done = await task
        assert [v for v, _ in done.meta["weight_versions"]] == [0, 1]
        assert engine.cache.tokens == 0  # its KV mixes both weight versions

    asyncio.run(main())


def test_chunked_prefill_gives_the_same_result(models):
    chunked, whole = engine_for(models), engine_for(models, prefix_cache_bytes=0)
    chunked.prefill_chunk_tokens = 7
    a, b = episodes(chunked, 2, n=2), episodes(whole, 2, n=2)
    for x, y in zip(flat(a), flat(b)):
        assert x.output_ids == y.output_ids
        assert np.allclose(x.output_logprobs, y.output_logprobs, atol=1e-5, rtol=0)
    assert chunked.stats["prefill_batches"] >= 3 + 1  # the 20-token prompts took 3 chunks


def test_retract_and_abort_keep_working_with_the_cache(models):
    engine = engine_for(models)
    prompt = prompts(1, 20, seed=4)[0]
    plain = engine_for(models, prefix_cache_bytes=0)

    async def main(e, retract):
        task = asyncio.create_task(e.generate(prompt, SamplingParams(max_new_tokens=30, temperature=0)))
        if retract:
            while e.stats["decode_steps"] < 4:
                await asyncio.sleep(0.001)
            await e.pause(PauseMode.RETRACT)
            await e.resume()
        return await task

    got, want = asyncio.run(main(engine, True)), asyncio.run(main(plain, False))
    assert got.meta["retractions"] == 1 and got.output_ids == want.output_ids
    assert np.allclose(got.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)
    assert len(engine._free_slots) == engine.max_batch_size


def kv(n: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(start, start + n, dtype=torch.float32).view(1, 1, n, 1)
    return k, -k


def test_radix_tree_splits_shares_and_evicts_least_recently_used():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 2, 3, 4], lambda a, b: kv(b - a, a), None)
    cache.insert([1, 2, 5], lambda a, b: kv(b - a, 100 + a), None)
    assert cache.tokens == 5  # [1, 2] shared, then [3, 4] and [5]
    n, path = cache.match([1, 2, 3, 9], 4, False)
    k, v, _ = PrefixCache.gather(path)
    assert n == 3 and k.flatten().tolist() == [0, 1, 2] and v.flatten().tolist() == [0, -1, -2]
    n, path = cache.match([1, 2, 5, 6], 4, False)
    assert n == 3 and PrefixCache.gather(path)[0].flatten().tolist() == [0, 1, 102]
    assert cache.match([1, 2, 3, 4], 2, False)[0] == 2  # the limit leaves the last token to compute
    cache.match([1, 2, 3], 3, False)  # touch [3, 4]: [5] is now the oldest leaf
    cache.insert([7, 8, 9, 10, 11, 12], lambda a, b: kv(b - a), None)
    assert cache.tokens == 10 and cache.match([1, 2, 5], 3, False)[0] == 2
    assert cache.match([1, 2, 3, 4], 4, False)[0] == 4
    cache.insert(list(range(20, 40)), lambda a, b: kv(b - a), None)  # bigger than the cap: nothing stays over it
    assert cache.tokens <= 10
    cache.clear()
    assert cache.tokens == 0 and cache.match([1, 2], 2, False)[0] == 0


def test_routing_rows_are_stored_and_filled_in():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3], lambda a, b: kv(b - a, a), None)
    assert cache.match([1, 2, 3], 3, True)[0] == 0
    rows = np.arange(3, dtype=np.int32).reshape(3, 1, 1)
    cache.insert([1, 2, 3], lambda a, b: kv(b - a, a), rows)
    n, path = cache.match([1, 2, 3], 3, True)
    assert n == 3 and PrefixCache.gather(path)[2].flatten().tolist() == [0, 1, 2]


def test_an_episodes_next_turn_takes_its_warm_slot_back_and_copies_nothing(models):
    """A freed slot remembers the tokens its KV covers; the episode's next turn starts with them and gets that
    slot back (no copy out of the tree), with bitwise the logprobs of the tree's copy."""
    warm, copied = engine_for(models), engine_for(models)
    copied._warm_slot = lambda tokens: None  # every hit copies its prefix out of the tree
    a, b = episodes(warm, 3), episodes(copied, 3)
    assert [x.output_logprobs for x in flat(a)] == [y.output_logprobs for y in flat(b)]
    # turns 2 and 3 of the 3 episodes: the whole previous sequence (prompt + reply but its last token) was warm
    assert warm.stats["warm_slot_tokens"] == 3 * sum(20 + 17 * t - 6 for t in range(1, 3))
    assert warm.stats["cached_tokens"] == copied.stats["cached_tokens"] and copied.stats["warm_slot_tokens"] == 0


def test_a_warm_slot_is_not_reused_after_a_weight_update_or_by_another_prompt(models):
    engine = engine_for(models)
    first, other = prompts(2, 30, seed=12)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)

    async def main():
        out = await engine.generate(first, greedy)
        await engine.generate(other, greedy)  # shares no prefix: must not take (or trust) the warm slot
        assert engine.stats["warm_slot_tokens"] == 0
        await engine.update_weights([(n, p.detach() * 1.01) for n, p in engine.model.named_parameters()], 1)
        second = first + out.output_ids
        reply = await engine.generate(second, greedy)  # the old weights' KV: recomputed
        assert engine.stats["warm_slot_tokens"] == 0
        await engine.generate(second + reply.output_ids + [1, 2], greedy)  # the new weights' KV: warm
        return engine.stats["warm_slot_tokens"]

    assert asyncio.run(main()) > 0
