"""Benchmark: wall time to a target reward on arith-tools, miles-agent vs TRL's GRPOTrainer.

Both start from the same shipped warm start with the tiny-cpu recipe's batch (8 tasks x 8 samples),
learning rate, temperature and per-turn token limit, and stop at the first step whose mean reward
reaches ``--target``. Time counts training steps only (model loading left out on both sides).

TRL runs **single-turn**: its GRPOTrainer samples one completion per prompt with HF ``generate``.
Its multi-turn tool loop needs a response parser for the chat template (TRL ships them for the
stock Qwen/Llama/GLM templates, not for our tiny model's), so the env's tools cannot answer
mid-episode. The reward function is the environment's own scorer: it opens an arith-tools
session, executes the tool calls found in the completion (the model never sees their results)
and scores the completion as the episode's last assistant message. A policy that calls the tool
and then answers ``<answer>ans</answer>`` in the same completion scores 1, as in the env.

    python bench/e2e_vs_trl.py                 # target 0.7, at most 20 steps each
    python bench/e2e_vs_trl.py --quick         # proves the machinery: 1 step each, tiny batch
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

import torch

RECIPE = "tiny-cpu"


class _Reached(Exception):
    pass


class _StopAtTarget:
    """A stand-in progress view that stops the run once the target reward is reached."""

    def __init__(self, target: float, max_steps: int) -> None:
        self.target, self.max_steps, self.records = target, max_steps, []

    def phase(self, *_: Any, **__: Any) -> None: ...

    def episode_done(self, *_: Any) -> None: ...

    def micro_batch_done(self, *_: Any) -> None: ...

    def track_sync(self, weights: Any) -> Any:
        return weights

    def step_done(self, record: dict[str, Any], line: str) -> None:
        self.records.append(record)
        if record["reward_mean"] >= self.target or len(self.records) >= self.max_steps:
            raise _Reached

    def close(self) -> None: ...


def ours(target: float, max_steps: int, overrides: dict[str, Any], run_dir: str) -> dict[str, Any]:
    from miles_agent.config import load_config
    from miles_agent.loop import Run

    cfg = load_config(RECIPE, {**overrides, "run.steps": max_steps, "run.run_dir": run_dir, "run.progress": False,
                               "run.log_samples": 0})
    run, view = Run(cfg), _StopAtTarget(target, max_steps)

    async def go() -> None:
        try:
            await run.train(view)
        except _Reached:
            pass
        finally:
            for e in run.engines:
                await e.shutdown()
            run.trainer.close()
            run.metrics.close()

    asyncio.run(go())
    times = [r["time/step"] for r in view.records]
    rewards = [r["reward_mean"] for r in view.records]
    return _summary(rewards, times, target)


def _summary(rewards: list[float], step_times: list[float], target: float) -> dict[str, Any]:
    hit = next((i for i, r in enumerate(rewards) if r >= target), None)
    upto = step_times if hit is None else step_times[: hit + 1]
    return {"reached": hit is not None, "steps": len(upto), "seconds": sum(upto), "rewards": rewards}


def score_completion(env: Any, task: Any, text: str) -> float:
    """The env's scorer on a single completion, after running the tool calls it contains."""
    from miles_agent.environment import ToolError
    from miles_agent.harnesses.chat_tools import parse_tool_calls

    async def go() -> float:
        session = await env.open(task)
        try:
            calls, _ = parse_tool_calls(text)
            for call in calls:
                try:
                    await session.call_tool(call.name, call.arguments)
                except ToolError:
                    pass
            return (await session.score([{"role": "assistant", "content": text}])).value
        finally:
            await session.close()

    return asyncio.run(go())


def trl(target: float, max_steps: int, overrides: dict[str, Any], out_dir: str) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles_agent.config import load_config
    from miles_agent.loop import build_env
    from miles_agent.models.loading import load_policy

    cfg = load_config(RECIPE, overrides)
    env = build_env(cfg)
    torch.manual_seed(cfg.run.seed)
    model, tok = load_policy(cfg, env)
    n_prompts, k = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    tasks = env.tasks("train")[: n_prompts * max_steps]
    by_prompt: dict[str, Any] = {}
    for t in tasks:
        text = tok.apply_chat_template(list(t.messages), tools=[*env_tools(env, t)], add_generation_prompt=True,
                                       tokenize=False)
        by_prompt[text] = t  # arith-tools prompts are unique per task

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [score_completion(env, by_prompt[p], c) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.rewards: list[float] = []
            self.times: list[float] = []
            self.t = 0.0

        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            self.times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **kw):  # noqa: ANN001, ANN201
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                if logs["reward"] >= target:
                    control.should_training_stop = True

    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n_prompts * k, num_generations=k,
                      max_completion_length=cfg.env.max_new_tokens_per_turn, temperature=cfg.rollout.temperature,
                      learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
                      max_grad_norm=cfg.train.grad_clip, beta=0.0, loss_type="dapo", epsilon=cfg.algo.clip_eps,
                      max_steps=max_steps, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                      bf16=False, fp16=False, seed=cfg.run.seed, shuffle_dataset=False, disable_tqdm=True)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": list(by_prompt)}), callbacks=[clock])
    trainer.train()
    return _summary(clock.rewards, clock.times[: len(clock.rewards)], target)


def env_tools(env: Any, task: Any) -> list[dict[str, Any]]:
    session = asyncio.run(env.open(task))
    return list(getattr(session, "tools", []) or [])


def measure(quick: bool = False, target: float = 0.7, max_steps: int = 20) -> dict[str, Any]:
    from miles_agent.errors import require

    require("trl", "bench", "the TRL baseline")
    overrides: dict[str, Any] = {}
    if quick:
        target, max_steps = 0.0, 1
        overrides = {"rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4,
                     "env.max_new_tokens_per_turn": 24}
    with tempfile.TemporaryDirectory() as d:
        a = ours(target, max_steps, overrides, f"{d}/ours")
        b = trl(target, max_steps, overrides, f"{d}/trl")
    if a["reached"] and b["reached"]:
        ratio, note = b["seconds"] / a["seconds"], ""
    elif a["reached"]:
        ratio, note = b["seconds"] / a["seconds"], f"TRL did not reach {target} in {b['steps']} steps: a lower bound"
    else:
        ratio, note = float("nan"), f"miles-agent did not reach {target} in {max_steps} steps"
    return {"ratios": {f"time to reward {target}: TRL single-turn / miles-agent": [ratio]},
            "detail": {"target": target, "max_steps": max_steps, "ours": a, "trl_single_turn": b, "note": note}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--max-steps", type=int, default=20)
    a = ap.parse_args()
    out = measure(a.quick, a.target, a.max_steps)
    for name, (ratio,) in out["ratios"].items():
        print(f"{name}: {ratio:.2f}x")
    d = out["detail"]
    for side in ("ours", "trl_single_turn"):
        s = d[side]
        print(f"  {side:16s} reached={s['reached']} after {s['steps']} steps, {s['seconds']:.1f} s; "
              f"rewards {' '.join(f'{r:.2f}' for r in s['rewards'])}")
    if d["note"]:
        print(f"  note: {d['note']}")


if __name__ == "__main__":
    main()
