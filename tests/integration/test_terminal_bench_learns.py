"""terminal-bench learns on a laptop: RL from the shipped warm start raises the starter family's pass rate.

The short version of `miles-agent train --env terminal-bench --recipe tiny-cpu` (docs/results.md has the
full run): real episodes in the local sandbox, scored by each task's test.sh, GRPO on the FSDP2 trainer.
The warm start often says it is done without running anything; RL must make it act. About 90 s: 10
steps of 64 episodes, where the full run's reward went 0.08-0.19 over its first 3 steps and 0.36-0.47 over
steps 7-9; the margin below is three standard deviations of the difference of two 3-step means.
"""

from __future__ import annotations

from miles_agent.config import load_config
from miles_agent.loop import train


def test_rl_from_the_warm_start_raises_the_pass_rate(tmp_path):
    cfg = load_config("tiny-cpu", {"env.name": "terminal-bench", "run.steps": STEPS, "run.run_dir": str(tmp_path),
                                   "run.progress": False})
    records = train(cfg)
    rewards = [r["reward_mean"] for r in records]
    assert all(r["failed"] == 0 for r in records), [r["failed"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first >= MIN_GAIN, rewards
    turns = [r["turns"] for r in records]  # 1: claimed done at once; 2: ran a command, then said so
    assert sum(turns[-3:]) > sum(turns[:3]), turns


STEPS = 10
MIN_GAIN = 0.1
