"""A scripted demonstrator for arith-tools, speaking the `Policy` contract.

It calls the calculator on the question (no arguments) and answers with ANS, or -- at rate
``1 - tool_rate`` -- guesses a number without the tool.

It plays episodes through the real harness, so its trajectories are genuine TITO data (the warm
start's SFT set). With ``tool_rate=1`` it is the oracle; with 0.5 it is a lazy demonstrator that
guesses half the time -- the warm start RL has to improve on.
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

from miles_agent.engine import Completion, FinishReason, SamplingParams
from miles_agent.envs.arith_tools.calc import evaluate, format_result

_QUESTION = re.compile(r"What is ([0-9+\-*()]+)\?")
_RESULT = re.compile(r"<tool_response>([+-]?\d+)</tool_response>")


class ArithDemonstrator:
    def __init__(self, tokenizer: Any, tool_rate: float = 0.5, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.tool_rate = tool_rate
        self.seed = seed

    async def generate(self, input_ids: list[int], sampling: SamplingParams, *,
                       return_routed_experts: bool = False) -> Completion:
        text = self.tokenizer.decode(input_ids)
        last_turn = text[text.rfind("<|im_start|>user"):]
        result = _RESULT.search(last_turn)
        if result:
            reply = "<answer>ans</answer>"  # the calculator's ANS register holds the result
        else:
            expr = _QUESTION.search(last_turn).group(1)
            # Deterministic per question, whatever order episodes run in.
            rng = random.Random(zlib.crc32(f"{self.seed}:{expr}:{len(input_ids)}".encode()))
            if rng.random() < self.tool_rate:
                reply = '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'  # evaluates the question
            else:
                true = evaluate(expr)
                guess = true + rng.choice((-1, 1)) * rng.randint(1, max(2, abs(true) // 10 + 1))
                reply = f"<answer>{format_result(guess)}</answer>"
        ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_new_tokens]
        finish = FinishReason.STOP if ids[-1] == self.tokenizer.eos_token_id else FinishReason.LENGTH
        return Completion(output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason=finish,
                          weight_version=0, prompt_tokens=len(input_ids))
