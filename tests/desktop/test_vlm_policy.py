"""A vision-language policy on the computer-use env: the chat-tools harness sends the screenshots as image
inputs (the opening screen and the screen after each action), the trajectory keeps them at their placeholder
ids, and a 2-step training run on the real desktop validates every trajectory with its images."""

from __future__ import annotations

import asyncio
import io
import shutil

import pytest

from miles_agent.engine import FinishReason, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.environment import EnvSession, HarnessLimits, Reward, Task
from miles_agent.harnesses.chat_tools import ChatToolsHarness
from miles_agent.models.builder import build_tiny
from miles_agent.models.vision import placeholder_count


def screen(shade: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 240), (shade, 40, 200 - shade)).save(buf, format="PNG")
    return buf.getvalue()


class ScreenSession(EnvSession):
    """A desktop stand-in: every action takes a new screenshot, as `DesktopSession` does."""

    tools = [{"type": "function", "function": {"name": "click", "description": "click",
                                               "parameters": {"type": "object", "properties": {}}}}]

    def __init__(self) -> None:
        self.screenshots = [screen(0)]

    async def opening_text(self):
        return "Screen 320x240. button 'Send' at (10, 10)"

    async def call_tool(self, name, arguments):
        self.screenshots.append(screen(20 * len(self.screenshots)))
        return "button 'Send' at (10, 10)"

    async def score(self, messages):
        return Reward(0.0)


class ClickingPolicy:
    """Answers with a click for two turns, then stops; records the images each request carried."""

    def __init__(self, engine: EmbeddedEngine, tok) -> None:
        self.engine, self.tok, self.seen = engine, tok, []

    async def generate(self, input_ids, sampling, *, return_routed_experts=False, images=()):
        self.seen.append(list(images))
        c = await self.engine.generate(input_ids, sampling, images=images)  # the real forward over the images
        text = '<tool_call>{"name": "click", "arguments": {}}</tool_call>' if len(self.seen) < 3 else "done"
        c.output_ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        c.output_logprobs = [-1.0] * len(c.output_ids)
        c.finish_reason = FinishReason.STOP
        return c


def test_the_harness_sends_each_screenshot_as_an_image_input_at_its_placeholders():
    model, tok = build_tiny("tiny-qwen3-vl")
    assert tok.image_placeholder_id == model.config.image_token_id
    policy = ClickingPolicy(EmbeddedEngine(model, tok, max_batch_size=2), tok)
    harness = ChatToolsHarness(tok, HarnessLimits(max_total_tokens=4096, max_new_tokens_per_turn=8),
                               SamplingParams(max_new_tokens=8))
    task = Task(id="t", messages=({"role": "user", "content": "Send the form."},))
    session = ScreenSession()
    [traj] = asyncio.run(harness.run(task, session, policy))
    traj.validate()
    assert [im.data for im in traj.images] == session.screenshots  # the opening screen, then one per action
    assert [len(s) for s in policy.seen] == [1, 2, 3]  # each request carries every image of its prompt
    pad = model.config.image_token_id
    assert [im.end - im.start for im in traj.images] == [placeholder_count(s) for s in session.screenshots]
    assert traj.tokens.count(pad) == sum(im.end - im.start for im in traj.images)
    assert traj.images[0].end <= len(traj.prompt_ids) < traj.images[1].start  # later screens are observations
    assert "<|vision_end|>Send the form.\n\nScreen 320x240." in tok.decode(traj.prompt_ids)


def test_a_text_only_policy_gets_the_same_turns_without_images(tokenizer):
    class Scripted:
        def __init__(self):
            self.kwargs = []

        async def generate(self, input_ids, sampling, **kw):
            from miles_agent.engine import Completion, FinishReason

            self.kwargs.append(kw)
            text = '<tool_call>{"name": "click", "arguments": {}}</tool_call>' if len(self.kwargs) < 2 else "ok"
            ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
            return Completion(ids, [-1.0] * len(ids), FinishReason.STOP, 0)

    harness = ChatToolsHarness(tokenizer, HarnessLimits(), SamplingParams())
    policy = Scripted()
    task = Task(id="t", messages=({"role": "user", "content": "Send the form."},))
    [traj] = asyncio.run(harness.run(task, ScreenSession(), policy))
    assert traj.validate().images == [] and policy.kwargs == [{}, {}]
    assert "Send the form.\n\nScreen 320x240." in tokenizer.decode(traj.prompt_ids)  # the opening screen, as text


DESKTOP_TOOLS = ("Xvfb", "openbox", "stterm", "xdotool", "mousepad", "chromium", "bwrap")
missing = [t for t in DESKTOP_TOOLS if not shutil.which(t)]


def train_two_steps(tmp_path, arch: str) -> list[dict]:
    from miles_agent.config import load_config
    from miles_agent.loop import train

    cfg = load_config("tiny-cpu", {
        "env.name": "desktop", "model.arch": arch, "model.warm_start": None, "env.max_total_tokens": 4000,
        "env.max_new_tokens_per_turn": 16, "env.max_turns": 2, "env.max_observation_tokens": 192,
        "env.options": {"tasks_dir": "", "max_a11y_nodes": 20, "width": 640, "height": 480},
        "run.steps": 2, "run.run_dir": str(tmp_path), "run.progress": False, "run.dump_rollouts": 1,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.concurrency": 4,
        "train.micro_batch_tokens": 8192})
    return train(cfg)


@pytest.mark.skipif(bool(missing), reason=f"apt-get install the desktop's packages (missing: {missing})")
@pytest.mark.slow  # two steps of 4 desktop episodes: a few minutes on 2 shared cores
@pytest.mark.parametrize("arch", ["tiny-qwen3-vl", "tiny-qwen3"])
def test_two_training_steps_on_the_desktop(tmp_path, arch):
    from miles_agent.dumps import ROLLOUTS_DIR, read_step, step_path

    records = train_two_steps(tmp_path, arch)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["episodes"] == 4 and r["failed"] == 0 for r in records)
    for step in (0, 1):
        trajs = read_step(step_path(tmp_path / ROLLOUTS_DIR, step)).trajectories
        assert len(trajs) == 4
        for t in trajs:
            t.validate()  # the loop validated them too; the dump round-trips the images
            if arch == "tiny-qwen3-vl":
                assert len(t.images) >= 1 and all(im.data[:8] == b"\x89PNG\r\n\x1a\n" for im in t.images)
                assert (t.images[0].width, t.images[0].height) == (640, 480)
            else:
                assert t.images == []
    assert (tmp_path / "final" / "config.json").is_file()
