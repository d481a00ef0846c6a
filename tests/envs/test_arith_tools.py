"""arith-tools: a safe calculator, an exact verifier, and a demonstrator whose oracle always scores 1."""

from __future__ import annotations

import asyncio

import pytest

from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits, ToolError
from miles_agent.envs.arith_tools import ArithToolsEnv
from miles_agent.envs.arith_tools.calc import evaluate, format_result
from miles_agent.harnesses.chat_tools import ChatToolsHarness


def test_calculator_is_exact_and_refuses_everything_else():
    assert evaluate("441*991") == 437031 and evaluate("(2-5)*3") == -9 and evaluate("-4+1") == -3
    for bad in ["__import__('os')", "2**99999", "1/0", "a+1", "9" * 70, "1+"]:
        with pytest.raises(ToolError):
            evaluate(bad)
    assert format_result(347) == "+0347" and format_result(-21) == "-0021" and format_result(9801) == "+9801"


def test_tasks_are_deterministic_and_splits_differ():
    env = ArithToolsEnv()
    a, b = env.tasks("train"), ArithToolsEnv().tasks("train")
    assert [t.id for t in a] == [t.id for t in b] and a[5].info == b[5].info
    evals = env.tasks("eval")
    assert evals[0].id.startswith("eval-") and [t.info["expr"] for t in evals[:20]] != [t.info["expr"] for t in a[:20]]
    with pytest.raises(ValueError, match="unknown split"):
        env.tasks("validation")


def run(env, tokenizer, policy, n=24):
    harness = ChatToolsHarness(tokenizer, HarnessLimits(), SamplingParams(max_new_tokens=96))

    async def main():
        out = []
        for task in env.tasks("eval")[:n]:
            session = await env.open(task)
            out += await harness.run(task, session, policy)
        return out

    return asyncio.run(main())


def test_oracle_scores_one_and_the_lazy_demonstrator_about_half(tokenizer):
    env = ArithToolsEnv()
    oracle = run(env, tokenizer, env.oracle_policy(tokenizer))
    assert all(t.validate().reward == 1.0 and t.num_turns == 2 for t in oracle)
    lazy = run(env, tokenizer, env.demonstrator(tokenizer, tool_rate=0.5), n=64)
    rewards = [t.validate().reward for t in lazy]
    assert 0.3 < sum(rewards) / len(rewards) < 0.7
    explicit = run(env, tokenizer, _ExplicitOracle(tokenizer), n=8)  # the calculator evaluates any expression
    assert all(t.validate().reward == 1.0 for t in explicit)
    assert all(t.reward == float(t.reward_parts["tool_calls"] > 0) for t in lazy)  # guesses are wrong


def test_verifier_reads_the_final_answer_only():
    env = ArithToolsEnv()
    task = env.tasks("eval")[0]
    answer = task.info["answer"]

    async def score(final: str):
        session = await env.open(task)
        return await session.score([{"role": "assistant", "content": f"<answer>{answer}</answer>"},
                                    {"role": "assistant", "content": final}])

    assert asyncio.run(score(f"<answer>{format_result(answer)}</answer>")).value == 1.0
    assert asyncio.run(score(f"<answer>{answer + 1}</answer>")).value == 0.0
    wrong_format = asyncio.run(score(str(answer)))
    assert wrong_format.value == 0.0 and wrong_format.parts["format"] == 0.0


class _ExplicitOracle:
    """Passes the expression explicitly and answers with the number itself (no ANS)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, input_ids, sampling, *, return_routed_experts=False):
        import re

        from miles_agent.engine import Completion, FinishReason

        text = self.tokenizer.decode(input_ids)
        result = re.search(r"<tool_response>([+-]\d+)</tool_response>", text)
        if result:
            reply = f"<answer>{int(result.group(1))}</answer>"
        else:
            expr = re.search(r"What is ([0-9+*-]+)\?", text).group(1)
            reply = f'<tool_call>{{"name": "calc", "arguments": {{"expr": "{expr}"}}}}</tool_call>'
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Completion(ids, [0.0] * len(ids), FinishReason.STOP, 0)


def test_shipped_warm_start_matches_the_current_tokenizer_and_arch():
    """A warm start built with another template or architecture is stale: rebuild it with
    `miles-agent warmstart --env arith-tools --out envs/arith_tools/warmstart/tiny-qwen3`."""
    from miles_agent.models.builder import load_hf
    from miles_agent.models.tokenizer import CHAT_TEMPLATE
    from miles_agent.warmstart import shipped_path

    path = shipped_path(ArithToolsEnv(), "tiny-qwen3")
    model, tok = load_hf(path)
    assert tok.chat_template == CHAT_TEMPLATE
    assert len(tok) == model.config.vocab_size and model.config.num_hidden_layers == 4
