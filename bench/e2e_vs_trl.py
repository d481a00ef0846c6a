"""Benchmark: wall time to a target reward on arith-tools, miles-agent vs TRL's GRPOTrainer.

Both start from the same shipped warm start with the tiny-cpu recipe's batch (8 tasks x 8 samples),
learning rate, temperature and per-turn token limit, and stop at the first step whose mean reward
reaches ``--target``. Time counts training steps only (model loading left out on both sides).

TRL runs **multi-turn** (``--trl-mode multi``, the default) through its experimental
``environment_factory`` tool loop: each sample gets an arith-tools session (the env's own
``calc`` tool and scorer), the model's ``<tool_call>`` is parsed with TRL's Qwen3 response
template (our tiny template writes the same tags), the result comes back as a tool message, and
the reward is the env's scorer on the final answer. The prompt renders the env's own tool schema,
so both sides see identical prompt tokens. Limits: TRL's ``max_completion_length`` spans the whole
multi-turn completion, set to 2 x the per-turn limit; ``max_tool_calling_iterations`` = max_turns - 1.

``--trl-mode single`` is the fallback for TRL versions without that loop: one completion per prompt;
the reward function runs the tool calls found in it (the model never sees their results) and scores
it as the last assistant message.

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


class ArithSession:
    """TRL's per-sample environment: an arith-tools session; its public methods are the tools."""

    env: Any = None  # set by trl(); TRL builds instances with no arguments
    tasks: dict[str, Any] = {}

    def reset(self, **row: Any) -> None:
        self.session = asyncio.run(self.env.open(self.tasks[row["task_id"]]))

    def calc(self, expr: str = "") -> str:
        """+-* calculator; no expr: the question

        Args:
            expr: the arithmetic to evaluate; leave it out to evaluate the question
        """
        return asyncio.run(self.session.call_tool("calc", {"expr": expr} if expr else {}))


def _session_score(e: ArithSession, final_text: str) -> float:
    return asyncio.run(e.session.score([{"role": "assistant", "content": final_text}])).value


def _final_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    texts = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return texts[-1] if texts else ""


def _render_env_tools(tok: Any, schemas: list[dict[str, Any]]) -> None:
    """Render the env's own tool schema wherever TRL passes its tool callables, so TRL's prompts are
    token-identical to ours (TRL would otherwise derive a schema from the docstring)."""
    original = tok.apply_chat_template

    def apply(*args: Any, tools: Any = None, **kw: Any) -> Any:
        if tools:
            tools = [schemas[0] if callable(t) else t for t in tools]
        return original(*args, tools=tools, **kw)

    tok.apply_chat_template = apply


def trl(target: float, max_steps: int, overrides: dict[str, Any], out_dir: str, mode: str = "multi") -> dict[str, Any]:
    import os

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from miles_agent.build import build_env
    from miles_agent.config import load_config
    from miles_agent.models.loading import load_policy

    cfg = load_config(RECIPE, overrides)
    env = build_env(cfg)
    torch.manual_seed(cfg.run.seed)
    model, tok = load_policy(cfg, env)
    n_prompts, k = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    tasks = env.tasks("train")[: n_prompts * max_steps]
    multi: dict[str, Any] = {}
    if mode == "multi":
        from trl.chat_template_utils import qwen3_template

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        tok.response_template = qwen3_template  # parses <tool_call>{json}</tool_call>, as our template writes
        _render_env_tools(tok, env_tools(env, tasks[0]))
        ArithSession.env, ArithSession.tasks = env, {t.id: t for t in tasks}
        multi = {"environment_factory": ArithSession}
    by_prompt: dict[str, Any] = {}
    for t in tasks:
        text = tok.apply_chat_template(list(t.messages), tools=[*env_tools(env, t)], add_generation_prompt=True,
                                       tokenize=False)
        by_prompt[text] = t  # arith-tools prompts are unique per task

    def reward(prompts: list[Any], completions: list[Any], environments: Any = None, **_: Any) -> list[float]:
        if environments is not None:
            return [_session_score(e, _final_text(c)) for e, c in zip(environments, completions)]
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

    turns = cfg.env.max_turns
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n_prompts * k, num_generations=k,
                      max_completion_length=cfg.env.max_new_tokens_per_turn * (2 if multi else 1),
                      max_tool_calling_iterations=turns - 1 if multi else None, temperature=cfg.rollout.temperature,
                      learning_rate=cfg.train.lr, lr_scheduler_type="constant", warmup_steps=0,
                      max_grad_norm=cfg.train.grad_clip, beta=0.0, loss_type="dapo", epsilon=cfg.algo.clip_eps,
                      max_steps=max_steps, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
                      bf16=False, fp16=False, seed=cfg.run.seed, shuffle_dataset=False, disable_tqdm=True)
    clock = Clock()
    if multi:  # conversational prompts; the env session is opened per sample from task_id
        data = Dataset.from_dict({"prompt": [list(t.messages) for t in tasks], "task_id": [t.id for t in tasks]})
    else:
        data = Dataset.from_dict({"prompt": list(by_prompt)})
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, processing_class=tok,
                          train_dataset=data, callbacks=[clock], **multi)
    trainer.train()
    return _summary(clock.rewards, clock.times[: len(clock.rewards)], target)


def env_tools(env: Any, task: Any) -> list[dict[str, Any]]:
    session = asyncio.run(env.open(task))
    return list(getattr(session, "tools", []) or [])


def measure(quick: bool = False, target: float = 0.7, max_steps: int = 20, trl_mode: str = "multi") -> dict[str, Any]:
    from miles_agent.errors import require

    require("trl", "bench", "the TRL baseline")
    overrides: dict[str, Any] = {}
    if quick:
        target, max_steps = 0.0, 1
        overrides = {"rollout.prompts_per_step": 1, "rollout.samples_per_prompt": 2,
                     "env.max_new_tokens_per_turn": 16}
    with tempfile.TemporaryDirectory() as d:
        a = ours(target, max_steps, overrides, f"{d}/ours")
        b = trl(target, max_steps, overrides, f"{d}/trl", trl_mode)
    if a["reached"] and b["reached"]:
        ratio, note = b["seconds"] / a["seconds"], ""
    elif a["reached"]:
        ratio, note = b["seconds"] / a["seconds"], f"TRL did not reach {target} in {b['steps']} steps: a lower bound"
    else:
        ratio, note = float("nan"), f"miles-agent did not reach {target} in {max_steps} steps"
    return {"ratios": {f"time to reward {target}: TRL GRPOTrainer ({trl_mode}-turn) / miles-agent": [ratio]},
            "detail": {"target": target, "max_steps": max_steps, "trl_mode": trl_mode, "ours": a, "trl": b,
                       "note": note}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--target", type=float, default=0.7)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--trl-mode", choices=["multi", "single"], default="multi")
    a = ap.parse_args()
    out = measure(a.quick, a.target, a.max_steps, a.trl_mode)
    for name, (ratio,) in out["ratios"].items():
        print(f"{name}: {ratio:.2f}x")
    d = out["detail"]
    for side in ("ours", "trl"):
        s = d[side]
        print(f"  {side:16s} reached={s['reached']} after {s['steps']} steps, {s['seconds']:.1f} s; "
              f"rewards {' '.join(f'{r:.2f}' for r in s['rewards'])}")
    if d["note"]:
        print(f"  note: {d['note']}")


if __name__ == "__main__":
    main()
