"""Each dotted-path plug-in kind: called with its documented arguments, its result used as documented, and
a bad path or a wrong signature refused at start in one line naming the key, the path and the signature."""

from __future__ import annotations

import asyncio

import pytest
import torch

from miles_agent import plugins
from miles_agent.algorithms.batch_builder import apply_mask_filter
from miles_agent.algorithms.dynamic_sampling import InformativeGroupFilter
from miles_agent.algorithms.estimators import estimate
from miles_agent.algorithms.losses import aggregate, compute_loss
from miles_agent.build import check_choices
from miles_agent.config import AlgoConfig, load_config
from miles_agent.engine import SamplingParams
from miles_agent.environment import HarnessLimits
from miles_agent.envs.arith_tools import ArithToolsEnv
from miles_agent.errors import UserError
from miles_agent.harnesses.chat_tools import ChatToolsHarness
from miles_agent.plugins import RewardEnv, batch_rewards
from miles_agent.rollout.episodes import EpisodeRunner
from miles_agent.types import Trajectory

SOURCE = '''
    import torch
    from miles_agent.environment import Reward

    CALLS = []

    async def judged(task, messages, env_reward):
        CALLS.append(("reward", task.id, messages[-1]["role"], env_reward.value))
        return Reward(0.5, {"judge": 0.5})

    def group(task, responses, trajectories):
        CALLS.append(("group", task.id if task else None, list(responses)))
        return [float(len(r)) for r in responses]

    async def post(rewards, trajectories):
        CALLS.append(("post", list(rewards)))
        return [r / 10 for r in rewards]

    def centered(rewards, group_ids, *, trajectories, algo):
        return [r - 1.0 for r in rewards]

    def per_token(rewards, group_ids, **kw):
        return [[float(i) for i in range(t.response_length)] for t in kw["trajectories"]]

    def short(rewards, group_ids, **kw):
        return [0.0]

    def linear(logp, old_logp, advantages, *, mask, **_):
        return -(logp * advantages), None

    def total(values, mask, *, num_tokens, num_seqs, row_weights):
        return (values * mask).sum()

    def drop_long(trajectory):
        return trajectory.response_length < 3

    def first_token_only(trajectory):
        return [1] + [0] * (trajectory.response_length - 1)

    def never(group):
        return False

    def nothing():
        return None

    class Hooks:
        def after_rollout(self, step, trajectories):
            return {"n": float(len(trajectories))}

        async def after_train_step(self, step, metrics):
            return {"loss_seen": metrics["loss"]}

        def before_train_step(self, step, batch):
            return None

    class BadHook:
        def after_rollout(self, step):
            return {}

    class NotDict:
        def after_rollout(self, step, trajectories):
            return 1.0

    class Sink:
        rows = []

        def __init__(self, run_dir, config, resume):
            self.run_dir = run_dir

        def write(self, record):
            Sink.rows.append(record)

        def close(self):
            Sink.rows.append("closed")
'''


@pytest.fixture(scope="module")
def mod(user_module):
    import importlib

    return importlib.import_module(user_module("contract_fns", SOURCE))


def traj(response: list[int], reward: float = 0.0, group: str = "g", trainable: bool = True) -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2], task_id="t0", group_id=group, reward=reward)
    t.append_model(response, [-0.5] * len(response), weight_version=0, turn=0, trainable=trainable)
    return t


def refused(overrides: dict, *needles: str) -> str:
    with pytest.raises(UserError) as e:
        check_choices(load_config("tiny-cpu", overrides))
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.mark.parametrize(("key", "expected"), [
    ("env.reward", "fn(task, messages, env_reward)"),
    ("env.group_reward", "fn(task, responses, trajectories)"),
    ("env.reward_post", "fn(rewards, trajectories)"),
    ("algo.advantage", "fn(rewards, group_ids, *, trajectories, algo)"),
    ("algo.loss", "fn(logp, old_logp, advantages, *, mask"),
    ("algo.loss_agg", "fn(values, mask, *, num_tokens, num_seqs, row_weights)"),
    ("algo.loss_mask_filter", "fn(trajectory)"),
    ("rollout.group_filter", "fn(group)"),
    ("rollout.buffer_filter", "fn(trajectories)"),
    ("rollout.function", "async fn(ctx)"),
])
def test_a_wrong_signature_or_path_fails_at_start_naming_key_path_and_signature(mod, key, expected):
    wrong = "contract_fns:nothing"
    refused({key: wrong}, f"{key}={wrong}", "does not fit", expected)
    refused({key: "contract_fns:missing"}, f"{key}=contract_fns:missing", "cannot load it", "AttributeError")
    refused({key: "no_such_pkg.mod:fn"}, "No module named 'no_such_pkg'")


def test_hooks_and_sinks_are_checked_at_start(mod):
    refused({"run.hooks": "contract_fns:BadHook"}, "run.hooks=contract_fns:BadHook.after_rollout", "does not fit",
            "after_rollout(step, trajectories)")
    refused({"run.hooks": "contract_fns:linear"}, "has none of the hook methods")
    refused({"run.sinks": "tensorboard,contract_fns:Hooks"}, "run.sinks=contract_fns:Hooks",
            "Sink(*, run_dir, config, resume)")
    refused({"env.reward": "justaname"}, "env.reward=justaname", "not a dotted path")
    check_choices(load_config("tiny-cpu", {"run.hooks": "contract_fns:Hooks", "run.sinks": "contract_fns:Sink"}))


def test_a_rollout_function_needs_sync_mode(mod):
    refused({"rollout.function": "contract_fns:never", "rollout.mode": "async", "rollout.max_staleness": 1}, "rollout.mode=sync")


def test_an_episode_reward_function_scores_the_finished_conversation(mod, tokenizer, scripted):
    env = RewardEnv(ArithToolsEnv(num_tasks=8), None, "contract_fns:judged")
    harness = ChatToolsHarness(tokenizer, HarnessLimits(max_turns=1), SamplingParams(max_new_tokens=32))
    task = env.tasks("train")[0]
    (t,) = asyncio.run(EpisodeRunner(env, harness, max_retries=0).run(task, scripted(["<answer>1</answer>"]), "g"))
    assert t.reward == 0.5 and t.reward_parts["judge"] == 0.5 and t.reward_parts["env_reward"] == 0.0
    assert mod.CALLS[-1] == ("reward", task.id, "assistant", 0.0)


def test_group_reward_then_post_processing_rewrite_the_batch(mod, tokenizer):
    class Cfg:
        class env:  # noqa: N801
            group_reward, reward_post = "contract_fns:group", "contract_fns:post"

    a, b = tokenizer.encode("ab", add_special_tokens=False), tokenizer.encode("abcd", add_special_tokens=False)
    trajs = [traj(a, 1.0), traj(b, 0.0)]
    asyncio.run(batch_rewards(Cfg, trajs, {}, tokenizer))
    assert ("group", None, ["ab", "abcd"]) in mod.CALLS and ("post", [2.0, 4.0]) in mod.CALLS
    assert [t.reward for t in trajs] == [0.2, 0.4] and trajs[0].reward_parts["env_reward"] == 1.0


def test_a_user_advantage_is_broadcast_or_taken_per_token(mod):
    trajs = [traj([5, 6, 7], 2.0), traj([5, 6], 0.0)]
    rows, _ = estimate(AlgoConfig(advantage="contract_fns:centered"), trajs)
    assert rows == [[1.0, 1.0, 1.0], [-1.0, -1.0]]
    rows, _ = estimate(AlgoConfig(advantage="contract_fns:per_token"), trajs)
    assert rows == [[0.0, 1.0, 2.0], [0.0, 1.0]]
    with pytest.raises(ValueError, match="returned 1 values for 2 trajectories"):
        estimate(AlgoConfig(advantage="contract_fns:short"), trajs)


def test_a_user_policy_loss_and_reducer_make_the_loss(mod):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = compute_loss(logp, logp.detach(), adv, mask, loss="contract_fns:linear", loss_agg="contract_fns:total")
    assert loss.item() == pytest.approx(-(-1.0 - 2.0) + -0.5)  # sum of -logp*A over the masked tokens
    assert "clipfrac" not in metrics  # the user loss reported no clip mask
    loss.backward()
    assert logp.grad.tolist() == [[-1.0, -1.0], [1.0, 0.0]]
    assert aggregate(torch.ones(2, 2), mask, "contract_fns:total").item() == 3.0


def test_a_loss_mask_filter_zeroes_or_narrows_masks(mod):
    trajs = [traj([5, 6]), traj([5, 6, 7, 8])]
    assert apply_mask_filter("contract_fns:drop_long", trajs) == {"loss_mask_filter/changed": 1.0}
    assert [t.loss_mask for t in trajs] == [[1, 1], [0, 0, 0, 0]]
    trajs = [traj([5, 6, 7])]
    apply_mask_filter("contract_fns:first_token_only", trajs)
    assert trajs[0].loss_mask == [1, 0, 0]


def test_a_user_group_filter_runs_on_the_dynamic_sampling_budget(mod):
    f = InformativeGroupFilter(groups_per_step=1, max_rounds=3, predicate=plugins.load("rollout.group_filter",
                                                                                        "contract_fns:never"))
    assert [f([traj([1])]) for _ in range(3)] == [False, False, True]  # 2 rejections, then forced
    assert f.step_metrics() == {"dynamic_sampling/kept_groups": 0.0, "dynamic_sampling/dropped_groups": 2.0,
                                "dynamic_sampling/forced_groups": 1.0}


def test_hooks_return_metrics_under_hooks_prefix(mod):
    hooks = plugins.Hooks("contract_fns:Hooks")
    assert asyncio.run(hooks.fire("after_rollout", 0, [1, 2, 3])) == {"hooks/n": 3.0}
    assert asyncio.run(hooks.fire("after_train_step", 0, {"loss": 0.5})) == {"hooks/loss_seen": 0.5}
    assert asyncio.run(hooks.fire("before_train_step", 0, None)) == {}
    assert asyncio.run(hooks.fire("on_run_end", None, [])) == {}  # not defined: skipped
    with pytest.raises(TypeError, match="return a dict of metrics"):
        asyncio.run(plugins.Hooks("contract_fns:NotDict").fire("after_rollout", 0, []))


def test_a_user_sink_gets_every_record(mod, tmp_path):
    (sink,) = plugins.user_sinks("contract_fns:Sink", tmp_path, {}, False)
    assert sink.run_dir == tmp_path
    sink.write({"step": 0})
    sink.close()
    assert mod.Sink.rows[-2:] == [{"step": 0}, "closed"]
    assert plugins.split_sinks("tensorboard, contract_fns:Sink") == ("tensorboard", ["contract_fns:Sink"])


def test_a_reward_that_is_not_a_number_is_named(user_module, tokenizer, scripted):
    user_module("bad_reward", """
        def text(task, messages, env_reward):
            return "1.0"
    """)
    env = RewardEnv(ArithToolsEnv(num_tasks=8), None, "bad_reward:text")
    harness = ChatToolsHarness(tokenizer, HarnessLimits(max_turns=1), SamplingParams(max_new_tokens=32))
    (t,) = asyncio.run(EpisodeRunner(env, harness, max_retries=0).run(env.tasks()[0], scripted(["1"]), "g"))
    assert t.status.value == "failed" and "env.reward=bad_reward:text returned ['1.0']" in t.metadata["error"]
