"""SGLangEngine against a fake SGLang server (real HTTP, a EmbeddedEngine behind it): generation, errors,
health, cache, memory, LoRA, and the contract's pause modes."""

from __future__ import annotations

import asyncio
import functools

import pytest

from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.engines.sglang.client import SGLangEngine
from miles_agent.models.builder import build_tiny
from miles_agent.transports.core import WeightSyncError

PROMPT = [5, 17, 42, 99, 3, 7]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


@functools.cache
def tiny(arch: str):
    return build_tiny(arch)


def reference(prompt, sampling, arch="tiny-qwen3", routed=False):
    model, tok = tiny(arch)
    engine = EmbeddedEngine(model, tok, max_batch_size=4)
    engine.eos_ids = frozenset()

    async def main():
        try:
            return await engine.generate(prompt, sampling, return_routed_experts=routed)
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_generate_matches_the_engine_behind_it(dense_server):
    ref = reference(PROMPT, GREEDY)
    client = SGLangEngine(dense_server.url)

    async def main():
        try:
            return await client.generate(PROMPT, GREEDY)
        finally:
            await client.shutdown()
    c = run(main)
    assert c.output_ids == ref.output_ids and len(c.output_ids) == 12
    assert c.output_logprobs == ref.output_logprobs  # JSON floats round-trip exactly
    assert c.finish_reason is FinishReason.LENGTH
    assert c.prompt_tokens == len(PROMPT)
    assert c.weight_version == 0 and c.meta["weight_versions"] == [(0, 0)]


def test_stop_token_finishes_with_what_matched(dense_server):
    ref = reference(PROMPT, GREEDY)
    stop = ref.output_ids[4]
    first = ref.output_ids.index(stop)
    client = SGLangEngine(dense_server.url)

    async def main():
        try:
            return await client.generate(PROMPT, SamplingParams(max_new_tokens=12, temperature=0,
                                                                stop_token_ids=(stop,)))
        finally:
            await client.shutdown()
    c = run(main)
    assert c.finish_reason is FinishReason.STOP
    assert c.output_ids == ref.output_ids[: first + 1]  # the stop token is kept, as SGLang does
    assert c.meta["matched_stop"] == stop


def test_bad_request_is_a_value_error_with_the_servers_message(dense_server):
    client = SGLangEngine(dense_server.url)

    async def main():
        try:
            await client.generate([10**7], GREEDY)
        finally:
            await client.shutdown()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(main)
    assert client.stats["engine_errors"] == 0  # bad input is the caller's fault, not the engine's


def test_health_model_info_and_flush_cache(dense_server):
    client = SGLangEngine(dense_server.url)

    async def main():
        try:
            assert await client.health()
            info = await client.get_model_info()
            assert info["is_generation"] and info["weight_version"] == str(client.weight_version)
            await client.flush_cache()  # idle: 200
            await client.pause(PauseMode.IN_PLACE)
            task = asyncio.ensure_future(client.generate(PROMPT, GREEDY))
            while dense_server.state()["waiting"] + dense_server.state()["running"] == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(WeightSyncError, match="HTTP 400.*running or waiting"):
                await client.flush_cache()  # SGLang refuses to flush with requests queued
            await client.resume()
            c = await task
            assert c.finish_reason is FinishReason.LENGTH
        finally:
            await client.shutdown()
    run(main)


def test_release_and_resume_memory_occupation(dense_server):
    client = SGLangEngine(dense_server.url)
    expected = reference(PROMPT, GREEDY).output_ids

    async def main():
        try:
            await client.release_memory_occupation(["kv_cache", "weights"])
            assert dense_server.state()["released"] == ["kv_cache", "weights"]
            with pytest.raises(ValueError, match="weights are released"):
                await client.generate(PROMPT, GREEDY)
            with pytest.raises(WeightSyncError, match="unknown memory tags"):
                await client.release_memory_occupation(["gpu_everything"])
            await client.resume_memory_occupation(None)
            assert dense_server.state()["released"] == []
            c = await client.generate(PROMPT, GREEDY)  # the KV cache regrows; generation is unchanged
            assert c.output_ids == expected
        finally:
            await client.shutdown()
    run(main)


def test_load_lora_adapter(dense_server, tmp_path):
    client = SGLangEngine(dense_server.url)
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "adapter_config.json").write_text("{}")

    async def main():
        try:
            with pytest.raises(WeightSyncError, match="no adapter_config.json"):
                await client.load_lora_adapter("bad", str(tmp_path / "missing"))
            out = await client.load_lora_adapter("good", str(tmp_path / "good"))
            assert out["loaded_adapters"] == {"good": str(tmp_path / "good")}
        finally:
            await client.shutdown()
    run(main)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes_through_http(dense_server, mode):
    client = SGLangEngine(dense_server.url)
    sampling = SamplingParams(max_new_tokens=30, temperature=0)
    ref = reference(PROMPT, sampling)

    async def main():
        try:
            tasks = [asyncio.ensure_future(client.generate(PROMPT, sampling)) for _ in range(2)]
            start = dense_server.state()["generated_tokens"]
            while dense_server.state()["generated_tokens"] < start + 6:
                await asyncio.sleep(0.01)
            await client.pause(PauseMode(mode))
            await asyncio.sleep(0.1)
            await client.resume()
            return await asyncio.gather(*tasks)
        finally:
            await client.shutdown()
    for c in run(main):
        if mode == "abort":
            assert c.finish_reason is FinishReason.ABORT and 0 < len(c.output_ids) < 30
            assert c.output_ids == ref.output_ids[: len(c.output_ids)]
        else:
            assert c.finish_reason is FinishReason.LENGTH and c.output_ids == ref.output_ids
            assert c.meta["retractions"] == (1 if mode == "retract" else 0)


def vlm_request():
    """A prompt with two expanded images for the tiny VLM: (model, tokenizer, ids, images, pngs)."""
    import io

    from PIL import Image

    from miles_agent.models.vision import expand_images

    model, tok = tiny("tiny-qwen3-vl")
    pngs = []
    for shade in (10, 200):
        buf = io.BytesIO()
        Image.new("RGB", (96, 64), (shade, 0, 0)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    prompt = tok.encode("look <|vision_start|><|image_pad|><|vision_end|> then <|vision_start|><|image_pad|>"
                        "<|vision_end|> now", add_special_tokens=False)
    ids, images = expand_images(prompt, model.config.image_token_id, pngs)
    return model, tok, ids, images, pngs


def test_images_go_as_image_data_beside_the_expanded_ids():
    """SGLang's multimodal /generate: ``input_ids`` with each image's expanded placeholder run, ``image_data``
    one base64 PNG data URL per image, in order."""
    from miles_agent.engines.sglang.wire import decode_image_data, generate_payload

    _, _, ids, images, pngs = vlm_request()
    payload = generate_payload(ids, GREEDY, return_routed_experts=False, images=images)
    assert payload["input_ids"] == ids and all(s.startswith("data:image/png;base64,") for s in payload["image_data"])
    assert decode_image_data(payload["image_data"]) == pngs
    assert "image_data" not in generate_payload(ids, GREEDY, return_routed_experts=False)


def test_the_fake_server_reads_image_data_as_the_engine_would():
    """The fake SGLang server (served in this process, on a loopback port) gets the images back from
    ``image_data`` and its engine's completion equals the engine's own on the same images."""
    from aiohttp import web

    from tests.sglang.fake_sglang_server import FakeSGLang

    model, tok, ids, images, pngs = vlm_request()
    engine = EmbeddedEngine(model, tok, max_batch_size=4)
    engine.eos_ids = frozenset()
    other = [images[0], type(images[1])(images[1].start, images[1].end, images[1].token_id, pngs[0])]

    async def main():
        ref = await engine.generate(ids, GREEDY, images=images)
        runner = web.AppRunner(FakeSGLang(engine, "tiny-qwen3-vl", {}).app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        client = SGLangEngine(f"http://127.0.0.1:{runner.addresses[0][1]}")
        try:
            c = await client.generate(ids, GREEDY, images=images)
            swapped = await client.generate(ids, GREEDY, images=other)
            with pytest.raises(ValueError, match="placeholder ids but its images cover 0"):
                await client.generate(ids, GREEDY)  # no image_data: the server refuses the image tokens (400)
            return ref, c, swapped
        finally:
            await client.shutdown()
            await runner.cleanup()

    ref, c, swapped = run(main)
    assert c.output_ids == ref.output_ids and c.output_logprobs == ref.output_logprobs
    assert swapped.output_logprobs != c.output_logprobs  # the server read the second image, not a default
