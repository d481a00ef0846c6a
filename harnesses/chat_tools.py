"""The chat/tool-call harness: the model writes tool calls in its family's format (Qwen-style
``<tool_call>{json}</tool_call>`` unless the model's config names another, `miles_agent.tool_calls`), the
environment runs the tools, and their results come back as tool messages -- until the model answers
without a tool call, or a limit ends the episode.

Every model turn appends exactly the ids the engine sampled; every environment turn appends only the
chat template's delta (see `miles_agent.tito`). Malformed tool calls become an error observation the
model can recover from, never a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from miles_agent.engine import Completion, FinishReason, Policy, SamplingParams
from miles_agent.environment import EnvSession, Harness, HarnessLimits, Task, ToolError
from miles_agent.harnesses import vision
from miles_agent.tito import ChatRenderer, NotAppendOnly
from miles_agent.tool_calls import QWEN, ToolCallFormat, tool_format
from miles_agent.types import Status, Trajectory


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the id the format wrote (Kimi-K2), echoed in the tool message


def parse_tool_calls(text: str, fmt: ToolCallFormat = QWEN) -> tuple[list[ToolCall], list[str]]:
    """Tool calls in a model turn, and an error message for each block that does not parse."""
    calls, errors = [], []
    for block in fmt.scan(text):
        if block.ok:
            calls.append(ToolCall(block.name, block.arguments, block.id))
        else:
            errors.append(f"error: malformed tool call ({block.error}); write {fmt.example}")
    if fmt.opener in text and fmt.unterminated(text):
        errors.append(f"error: unterminated {fmt.opener}; close it with {fmt.closer}")
    return calls, errors


class ChatToolsHarness(Harness):
    name = "chat-tools"
    description = "Multi-turn chat with Qwen-style tool calls; exact TITO trajectories."

    def __init__(self, tokenizer: Any, limits: HarnessLimits, sampling: SamplingParams) -> None:
        from miles_agent.models.tokenizer import stop_token_ids

        self.tokenizer = tokenizer
        self.limits = limits
        self.tool_format = tool_format(tokenizer)
        self.stop_ids = tuple(sorted(set(sampling.stop_token_ids) | set(stop_token_ids(tokenizer))))
        self.sampling = replace(sampling, stop_token_ids=self.stop_ids)
        self.image_id = vision.image_id(tokenizer)  # a vision-language policy: screenshots become image inputs

    async def run(self, task: Task, session: EnvSession, policy: Policy) -> list[Trajectory]:
        renderer = ChatRenderer(self.tokenizer, self.prompt_tools(session))
        messages = self.opening_messages(task)
        await vision.attach_opening(messages, session, image=self.image_id is not None)
        traj = self._new_branch(renderer, messages, task, 0)
        branches, turn, status = [traj], 0, Status.COMPLETED
        while True:
            budget = self.limits.max_total_tokens - len(traj.tokens)
            if budget <= 0:
                status = Status.TRUNCATED
                break
            sampling = replace(self.sampling, max_new_tokens=min(self.limits.max_new_tokens_per_turn, budget))
            images = {"images": list(traj.images)} if traj.images else {}  # the Policy call's optional keyword
            c = await policy.generate(list(traj.tokens), sampling, **images)
            if c.finish_reason is FinishReason.ABORT:
                return self._aborted(branches, c, turn)
            traj.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn,
                              version_starts=c.meta.get("weight_versions"))
            stop_text, text = self._split_stop(c)
            messages.append(self.tool_format.assistant_message(text))
            if c.finish_reason is FinishReason.LENGTH:
                status = Status.TRUNCATED
                break
            calls, errors = self.parse_actions(text)
            if not calls and not errors:
                break  # the model answered
            turn += 1
            if turn >= self.limits.max_turns:
                status = Status.TRUNCATED
                break
            screens = vision.screens(session)
            results = [await self._call(session, call, traj) for call in calls] + errors
            tool_msgs = self.observation_messages(calls, results)
            if self.image_id is not None:
                vision.attach_result(tool_msgs, session, screens)
            try:
                structured = messages[-1].get("content") != text  # the family rebuilds the turn from tool_calls
                obs = renderer.observation_ids(messages, tool_msgs, stop_text, sampled_text=text if structured else None)
                messages.extend(tool_msgs)
            except NotAppendOnly as e:
                messages.extend(tool_msgs)
                traj.metadata["branch_reason"] = str(e)
                traj = self._new_branch(renderer, messages, task, len(branches))
                branches.append(traj)
                continue
            obs, obs_images = vision.expand(obs, tool_msgs, self.image_id) if self.image_id is not None else (obs, [])
            if len(traj.tokens) + len(obs) >= self.limits.max_total_tokens:
                status = Status.TRUNCATED
                break
            traj.append_observation(obs, turn, obs_images)
        reward = await session.score(messages)
        for b in branches:
            b.reward, b.reward_parts, b.status = reward.value, dict(reward.parts), status
            b.metadata["turns"] = turn + 1
        return branches

    # -- the points a harness variant changes ---------------------------------------------------
    def prompt_tools(self, session: EnvSession) -> list[dict[str, Any]] | None:
        """Tool schemas the chat template renders into the prompt."""
        return session.tools

    system_instructions = ""  # a subclass's action format, put before the task's own system message

    def opening_messages(self, task: Task) -> list[dict[str, Any]]:
        messages = [dict(m) for m in task.messages]
        if not self.system_instructions:
            return messages
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = self.system_instructions + "\n" + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": self.system_instructions})
        return messages

    def parse_actions(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The actions in a model turn, plus an error message for each malformed one."""
        return parse_tool_calls(text, self.tool_format)

    def observation_messages(self, calls: list[ToolCall], results: list[str]) -> list[dict[str, Any]]:
        """Messages that carry the results back to the model (error results follow the calls' ones); a
        template that names the call (harmony) or its id (Kimi-K2) finds them on the message."""
        return [{"role": "tool", "content": r, **({"name": c.name} if c else {}),
                 **({"tool_call_id": c.id} if c and c.id else {})}
                for r, c in zip(results, [*calls, *[None] * (len(results) - len(calls))])]

    def _new_branch(self, renderer: ChatRenderer, messages: list[dict[str, Any]], task: Task,
                    index: int) -> Trajectory:
        ids, images = renderer.prompt_ids(messages), []
        if self.image_id is not None:
            ids, images = vision.expand(ids, messages, self.image_id)
        t = Trajectory(prompt_ids=ids, task_id=task.id, images=images)
        t.metadata["branch"] = index
        return t

    def _split_stop(self, c: Completion) -> tuple[str, str]:
        """(text of the sampled stop token or "", decoded content without it)."""
        ids = c.output_ids
        if c.finish_reason is FinishReason.STOP and ids and ids[-1] in self.stop_ids:
            return self.tokenizer.decode(ids[-1:]), self.tokenizer.decode(ids[:-1])
        return "", self.tokenizer.decode(ids)

    async def _call(self, session: EnvSession, call: ToolCall, traj: Trajectory) -> str:
        try:
            out = await session.call_tool(call.name, call.arguments)
        except ToolError as e:
            return f"error: {e}"
        ids = self.tokenizer.encode(out, add_special_tokens=False)
        cap = self.limits.max_observation_tokens
        if len(ids) > cap:
            traj.metadata["observation_truncated"] = traj.metadata.get("observation_truncated", 0) + 1
            out = self.tokenizer.decode(ids[:cap]) + f"\n[output truncated: {len(ids) - cap} more tokens]"
        return out

    def _aborted(self, branches: list[Trajectory], c: Completion, turn: int) -> list[Trajectory]:
        """Infrastructure ended the turn: keep what was sampled, untrained, and mark the episode for retry."""
        last = branches[-1]
        if c.output_ids:
            last.append_model(c.output_ids, c.output_logprobs, c.weight_version, turn, trainable=False)
        for b in branches:
            b.status = Status.ABORTED
        return branches
