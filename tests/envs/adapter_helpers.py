"""Playing one adapter episode through the external harness (the proxy in front of a policy)."""

from __future__ import annotations

import asyncio

from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.harnesses.external import ExternalHarness
from miles_agent.rollout.episodes import EpisodeRunner


def play(env, tokenizer, policy, task_index=0, limits=None, timeout=240.0, max_new_tokens=24):
    task = env.tasks("train")[task_index]
    harness = ExternalHarness(tokenizer, limits or HarnessLimits(max_new_tokens_per_turn=max_new_tokens),
                              SamplingParams(max_new_tokens=max_new_tokens), agent_timeout_s=timeout)

    async def main():
        try:
            return await EpisodeRunner(env, harness, max_retries=0).run(task, policy, group_id="g")
        finally:
            await env.aclose()

    return asyncio.run(main())


def model_texts(traj, tokenizer):
    """The text of each sampled span, as the package received it (EOS removed)."""
    out = []
    for span in traj.spans:
        if span.kind.value == "model":
            n = len(traj.prompt_ids)
            ids = traj.tokens[n + span.start:n + span.end]
            out.append(tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id]))
    return out


def play_all(env, tokenizer, policies, timeout=240.0, max_new_tokens=24, limits=None):
    """Task i played by policies[i], all at once (one event loop): what concurrent rollouts do."""
    tasks = env.tasks("train")
    harness = ExternalHarness(tokenizer, limits or HarnessLimits(max_new_tokens_per_turn=max_new_tokens),
                              SamplingParams(max_new_tokens=max_new_tokens), agent_timeout_s=timeout)

    async def main():
        runner = EpisodeRunner(env, harness, max_retries=0)
        try:
            return await asyncio.gather(*(runner.run(tasks[i], p, group_id=f"g{i}") for i, p in enumerate(policies)))
        finally:
            await env.aclose()

    return asyncio.run(main())


def tool_call(name, **arguments):
    """A Qwen-style tool-call block, as the model writes it (the proxy turns it into OpenAI tool_calls)."""
    import json

    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'
