"""The proxy speaks OpenAI's protocol: SDK-validated responses, OpenAI-shaped errors (400 naming the problem,
401 bad key, 404 unknown session), per-session isolation, limits, aborts and engine failures."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from proxy_helpers import ScriptEngine

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.harnesses.proxy import ProxyLimits, ProxyServer

pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai")

MSGS = [{"role": "user", "content": "hi"}]


def serve(engine, tokenizer, body, **server_kw):
    """Run ``body(server, session, client)`` against a fresh server; returns its result."""
    async def main():
        async with ProxyServer(engine, tokenizer, **server_kw) as server:
            session = server.open_session()
            async with openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as c:
                return await body(server, session, c)
    return asyncio.run(main())


def test_binds_loopback_and_each_key_opens_only_its_session(tokenizer):
    engine = ScriptEngine(tokenizer, ["a", "b"])

    async def body(server, s1, c1):
        assert server.url.startswith("http://127.0.0.1:")
        s2 = server.open_session()
        assert s1.api_key != s2.api_key and s1.base_url != s2.base_url
        async with httpx.AsyncClient() as h:
            url2 = s2.base_url + "/chat/completions"
            cross = await h.post(url2, json={"model": "m", "messages": MSGS},
                                 headers={"Authorization": f"Bearer {s1.api_key}"})
            missing = await h.post(url2, json={"model": "m", "messages": MSGS})
            unknown = await h.post(server.url + "/sessions/nope/v1/chat/completions", json={},
                                   headers={"Authorization": f"Bearer {s1.api_key}"})
            route = await h.get(server.url + "/v1/models")
        assert cross.status_code == 401 and cross.json()["error"]["code"] == "invalid_api_key"
        assert missing.status_code == 401 and "Bearer" in missing.json()["error"]["message"]
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
        assert route.status_code == 404 and "/sessions/{id}/v1" in route.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=s2.base_url, api_key="sk-wrong", max_retries=0).models.list()
        models = await c1.models.list()
        assert [m.id for m in models.data] == ["miles-policy"]
        await c1.chat.completions.create(model="m", messages=MSGS)
        server.close_session(s1)
        with pytest.raises(openai.NotFoundError):
            await c1.chat.completions.create(model="m", messages=MSGS)
        assert engine.inputs and not s2.trajectories()  # nothing reached session 2
        return s1.trajectories()

    trajs = serve(engine, tokenizer, body)
    assert len(trajs) == 1 and trajs[0].num_turns == 1


@pytest.mark.parametrize("change,param,words", [
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "use one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "only text parts"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"top_logprobs": 3, "logprobs": True}, "top_logprobs", "not supported"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", "'type': 'function'"),
    ({"max_tokens": 0}, "max_tokens", "positive integer"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
])
def test_bad_requests_get_400_naming_the_problem(tokenizer, change, param, words):
    async def body(server, s, c):
        async with httpx.AsyncClient() as h:
            return await h.post(s.base_url + "/chat/completions", json={"model": "m", "messages": MSGS, **change},
                                headers={"Authorization": f"Bearer {s.api_key}"})

    r = serve(ScriptEngine(tokenizer, []), tokenizer, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and words in err["message"], err


def test_invalid_json_body_is_a_400(tokenizer):
    async def body(server, s, c):
        async with httpx.AsyncClient() as h:
            return await h.post(s.base_url + "/chat/completions", content=b"{nope",
                                headers={"Authorization": f"Bearer {s.api_key}"})

    r = serve(ScriptEngine(tokenizer, []), tokenizer, body)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_logprobs_sampling_and_usage_are_the_engines(tokenizer):
    engine = ScriptEngine(tokenizer, ["héllo", "x" * 50])

    async def body(server, s, c):
        r = await c.chat.completions.create(model="m", messages=MSGS, logprobs=True, temperature=0.3, seed=9,
                                            max_tokens=500, stop=["zz"], tool_choice="none")
        r2 = await c.chat.completions.create(model="m", messages=MSGS + [
            {"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}],
            max_tokens=8)
        return r, r2, s.trajectories()

    r, r2, (traj,) = serve(engine, tokenizer, body, limits=ProxyLimits(max_new_tokens_per_turn=64),
                           sampling=SamplingParams(temperature=1.0))
    ids = tokenizer.encode("héllo", add_special_tokens=False) + [tokenizer.eos_token_id]
    lp = r.choices[0].logprobs.content
    assert [e.model_extra["token_id"] for e in lp] == ids
    assert [e.logprob for e in lp] == [-0.125 * (i % 7) for i in range(len(ids))]
    assert r.choices[0].message.content == "héllo" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(traj.prompt_ids)
    s0, s1 = engine.sampling
    assert (s0.temperature, s0.seed, s0.max_new_tokens, s0.stop) == (0.3, 9, 64, ("zz",))  # max_tokens capped
    assert tokenizer.eos_token_id in s0.stop_token_ids
    assert s1.max_new_tokens == 8 and r2.choices[0].finish_reason == "length"
    assert r2.choices[0].message.content == "x" * 8
    traj.reward = 0.0
    assert traj.num_turns == 2 and traj.validate()  # one branch: the second call extended the first


def test_training_mode_ignores_the_clients_sampling(tokenizer):
    engine = ScriptEngine(tokenizer, ["a"])

    async def body(server, s, c):
        await c.chat.completions.create(model="m", messages=MSGS, temperature=0.0, top_p=0.5)

    serve(engine, tokenizer, body, sampling=SamplingParams(temperature=0.8), honor_client_sampling=False)
    assert (engine.sampling[0].temperature, engine.sampling[0].top_p) == (0.8, 1.0)


def test_turn_and_context_limits_end_the_session_with_openai_errors(tokenizer):
    async def turns(server, s, c):
        await c.chat.completions.create(model="m", messages=MSGS)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=MSGS + [{"role": "user", "content": "again"}])
        return e.value, s

    err, s = serve(ScriptEngine(tokenizer, ["a"]), tokenizer, turns, limits=ProxyLimits(max_turns=1))
    assert err.code == "turn_limit_reached" and "turn limit" in s.truncated and s.turns == 1

    async def context(server, s, c):
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 100}])
        return e.value, s

    err, s = serve(ScriptEngine(tokenizer, []), tokenizer, context, limits=ProxyLimits(max_total_tokens=50))
    assert err.code == "context_length_exceeded" and "max_total_tokens=50" in s.truncated


def test_abort_is_a_503_without_retry_and_keeps_the_partial_turn_untrained(tokenizer):
    aborted = Completion([65, 66], [-0.1, -0.2], FinishReason.ABORT, 5, 3)
    engine = ScriptEngine(tokenizer, [aborted])

    async def body(server, s, c):
        async with httpx.AsyncClient() as h:
            r = await h.post(s.base_url + "/chat/completions", json={"model": "m", "messages": MSGS},
                             headers={"Authorization": f"Bearer {s.api_key}"})
            again = await h.post(s.base_url + "/chat/completions", json={"model": "m", "messages": MSGS},
                                 headers={"Authorization": f"Bearer {s.api_key}"})
        return r, again, s

    r, again, s = serve(engine, tokenizer, body)
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "generation_aborted" and again.status_code == 503
    (traj,) = s.trajectories()
    assert s.aborted and traj.response_ids == [65, 66] and traj.loss_mask == [0, 0]


def test_engine_failure_is_a_500_and_leaves_the_history_untouched(tokenizer):
    engine = ScriptEngine(tokenizer, [RuntimeError("CUDA fell over"), "ok"])

    async def body(server, s, c):
        with pytest.raises(openai.InternalServerError, match="CUDA fell over"):
            await c.chat.completions.create(model="m", messages=MSGS)
        await c.chat.completions.create(model="m", messages=MSGS)
        return s.trajectories()

    (traj,) = serve(engine, tokenizer, body)
    assert traj.num_turns == 1 and engine.inputs[0] == engine.inputs[1]


def test_completions_extend_their_text_history_token_in_token_out(tokenizer):
    engine = ScriptEngine(tokenizer, [" world", " again", "!"])

    async def body(server, s, c):
        r1 = await c.completions.create(model="m", prompt="Hello", logprobs=1)
        r2 = await c.completions.create(model="m", prompt="Hello" + r1.choices[0].text + "\nSay it", stream=False)
        chunks = [ch async for ch in await c.completions.create(model="m", prompt="Other", stream=True)]
        return r1, r2, chunks, s.trajectories()

    r1, r2, chunks, (text, other) = serve(engine, tokenizer, body)
    eos = tokenizer.eos_token_id
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    assert r1.choices[0].text == " world" and r1.choices[0].finish_reason == "stop"
    assert r1.choices[0].logprobs.tokens[:2] == [" ", "w"] and r1.choices[0].logprobs.text_offset[:2] == [0, 1]
    # the second prompt extended the first: only "\nSay it" was tokenized, after the sampled EOS
    assert text.tokens == enc("Hello") + enc(" world") + [eos] + enc("\nSay it") + enc(" again") + [eos]
    assert text.loss_mask == [1] * 7 + [0] * 7 + [1] * 7
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "!"
    assert chunks[-1].choices[0].finish_reason == "stop" and other.tokens == enc("Other!") + [eos]


def test_stop_string_is_left_out_of_the_reply_but_kept_in_the_token_history(tokenizer):
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    hit = Completion(enc("abc END"), [-0.5] * 7, FinishReason.STOP, 5, 0, meta={"matched_stop": " END"})
    engine = ScriptEngine(tokenizer, [hit, "next"])

    async def body(server, s, c):
        r = await c.chat.completions.create(model="m", messages=MSGS, stop=" END")
        await c.chat.completions.create(model="m", messages=MSGS + [
            {"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "go"}])
        return r, s.trajectories()

    r, (traj,) = serve(engine, tokenizer, body)
    assert r.choices[0].message.content == "abc" and r.choices[0].finish_reason == "stop"
    model, obs, _ = [traj.response_ids[sp.start:sp.end] for sp in traj.spans]
    assert model == enc("abc END")  # sampled, kept
    assert obs == enc("<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")  # end marker added once


def test_concurrent_requests_on_one_history_fork_branches_never_interleave(tokenizer):
    class Slow(ScriptEngine):
        async def generate(self, input_ids, sampling, *, return_routed_experts=False):
            await asyncio.sleep(0.05)
            return await super().generate(input_ids, sampling)

    engine = Slow(tokenizer, ["one", "two"])

    async def body(server, s, c):
        await asyncio.gather(*[c.chat.completions.create(model="m", messages=MSGS) for _ in range(2)])
        return s.trajectories()

    a, b = serve(engine, tokenizer, body)
    assert a.prompt_ids == b.prompt_ids and {a.num_turns, b.num_turns} == {1}
    assert sorted([tokenizer.decode(a.response_ids), tokenizer.decode(b.response_ids)]) == \
        ["one<|im_end|>", "two<|im_end|>"]


def test_token_id_prompts_extend_by_exact_ids(tokenizer):
    engine = ScriptEngine(tokenizer, ["x", "y"])

    async def body(server, s, c):
        await c.completions.create(model="m", prompt=[72, 105])
        (t,) = s.trajectories()
        await c.completions.create(model="m", prompt=t.tokens + [33, 33])
        return s.trajectories()

    (traj,) = serve(engine, tokenizer, body)
    eos = tokenizer.eos_token_id
    assert traj.tokens == [72, 105, ord("x"), eos, 33, 33, ord("y"), eos] and traj.loss_mask == [1, 1, 0, 0, 1, 1]


def test_server_must_be_started_before_sessions(tokenizer):
    with pytest.raises(RuntimeError, match="start the ProxyServer"):
        ProxyServer(ScriptEngine(tokenizer, []), tokenizer).open_session()


def test_template_that_drops_earlier_thinking_starts_a_new_branch(tokenizer):
    """Qwen3-style templates strip <think> from earlier assistant turns: the render is not append-only, so the
    proxy cannot extend the token history; it starts a fresh branch instead of corrupting the mask."""
    import copy

    qwen3ish = copy.deepcopy(tokenizer)
    plain = "{{ message.content or '' }}"
    assert plain in qwen3ish.chat_template
    qwen3ish.chat_template = qwen3ish.chat_template.replace(
        plain, "{{ (message.content or '') if loop.last else (message.content or '').split('</think>')[-1] }}")
    engine = ScriptEngine(qwen3ish, ["<think>secret</think>visible", "second"])

    async def body(server, s, c):
        r = await c.chat.completions.create(model="m", messages=MSGS)
        await c.chat.completions.create(model="m", messages=MSGS + [
            r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}])
        return s.trajectories()

    first, second = serve(engine, qwen3ish, body)
    assert (first.num_turns, second.num_turns) == (1, 1)
    assert "not append-only" in second.metadata["branch_reason"]
    assert "secret" not in qwen3ish.decode(second.prompt_ids) and "visible" in qwen3ish.decode(second.prompt_ids)
    for t in (first, second):
        t.reward = 1.0
        t.validate()


def test_a_session_past_its_ttl_stops_serving(tokenizer):
    async def body(server, s, c):
        short = server.open_session(ttl_s=0.2)
        await asyncio.sleep(0.3)
        async with openai.AsyncOpenAI(base_url=short.base_url, api_key=short.api_key, max_retries=0) as sc:
            with pytest.raises(openai.NotFoundError):
                await sc.models.list()
        await c.models.list()  # sessions without a ttl are unaffected
        return short, server

    short, server = serve(ScriptEngine(tokenizer, []), tokenizer, body)
    assert short.closed


def test_changing_the_tools_mid_session_starts_a_new_branch(tokenizer):
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}

    async def body(server, s, c):
        r = await c.chat.completions.create(model="m", messages=MSGS, tools=[tool])
        follow = MSGS + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        await c.chat.completions.create(model="m", messages=follow)  # same history, tools dropped
        return s.trajectories()

    a, b = serve(ScriptEngine(tokenizer, ["one", "two"]), tokenizer, body)
    assert "tools differ" in b.metadata["branch_reason"]
    assert "# Tools" in tokenizer.decode(a.prompt_ids) and "# Tools" not in tokenizer.decode(b.prompt_ids)
