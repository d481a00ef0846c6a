"""Every shipped instance: the gold patch scores 1.0 and the empty patch 0.0 (FAIL_TO_PASS failing,
PASS_TO_PASS passing), in a fresh sandbox, on the local sandbox and on the docker backend (a real
engine: `. .ci/container-engine.sh up`; its task-tools image has git and python3). The generator is
deterministic and the bundles carry only the base commit's history."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from miles_agent.envs.swe import SWEEnv
from miles_agent.envs.swe.shipped import build, build_shipped

URL = os.environ.get("MILES_AGENT_DOCKER_TEST_URL")
TOOLS_IMAGE = "localhost/miles-agent/task-tools:latest"  # made by .ci/container-engine.sh: trixie + git
IDS = sorted(json.loads(line)["instance_id"] for line in build_shipped()[0].read_text().splitlines())


def test_at_least_twenty_instances_each_with_hidden_and_visible_tests():
    rows = [json.loads(line) for line in build_shipped()[0].read_text().splitlines()]
    assert len(rows) >= 20
    for r in rows:
        assert r["FAIL_TO_PASS"] and r["PASS_TO_PASS"] and r["patch"].startswith("diff --git")
        assert all(t.split("::")[0] in r["test_patch"] for t in r["FAIL_TO_PASS"])


def test_generation_is_deterministic(tmp_path):
    first = [json.loads(line) for line in build(tmp_path / "a").read_text().splitlines()]
    again = [json.loads(line) for line in build(tmp_path / "b").read_text().splitlines()]
    assert first == again


def test_the_sandbox_repository_has_only_the_base_history(swe_env, tmp_path):
    inst = swe_env.instance(IDS[0])
    (tmp_path / "b.bundle").write_bytes(swe_env.repos.bundle(inst.repo, inst.base_commit))
    heads = subprocess.run(["git", "bundle", "list-heads", str(tmp_path / "b.bundle")], capture_output=True,
                           text=True, check=True).stdout.split()
    assert heads == [inst.base_commit, "refs/heads/base"]  # one branch, no other bug's or fix's commits


async def gold_and_empty(env: SWEEnv, instance_id: str):
    inst = env.instance(instance_id)
    return await asyncio.gather(env.score_patch(inst, inst.patch), env.score_patch(inst, ""))


def check(gold, empty, instance_id):
    assert gold.reward.value == 1.0, (instance_id, gold.reason)
    assert empty.reward.value == 0.0, (instance_id, empty.reason)
    assert empty.reward.parts["fail_to_pass"] == 0.0 and empty.reward.parts["pass_to_pass"] == 1.0, empty.reason
    assert "FAIL_TO_PASS 0/" in empty.reason and all(v == "passed" for v in gold.tests.values())


@pytest.mark.parametrize("instance_id", IDS)
def test_gold_scores_one_and_empty_zero_locally(swe_env, instance_id):
    check(*asyncio.run(gold_and_empty(swe_env, instance_id)), instance_id)


@pytest.fixture(scope="module")
def docker_env():
    if not URL:
        pytest.skip("no container engine configured: source .ci/container-engine.sh (MILES_AGENT_DOCKER_TEST_URL)")
    pytest.importorskip("docker")
    from miles_agent.sandboxes.docker import connect

    client = connect(URL)
    if not client.images(name=TOOLS_IMAGE):
        pytest.skip(f"the engine has no {TOOLS_IMAGE} (.ci/container-engine.sh up makes it)")
    return SWEEnv(sandbox="docker", sandbox_options={"base_url": URL, "image": TOOLS_IMAGE})


# Every instance nightly (about 20 s each on the shared engine); two of them in every CI run.
DOCKER_IDS = [i if n < 2 else pytest.param(i, marks=pytest.mark.slow) for n, i in enumerate(IDS)]


@pytest.mark.parametrize("instance_id", DOCKER_IDS)
def test_gold_scores_one_and_empty_zero_on_docker(docker_env, instance_id):
    check(*asyncio.run(gold_and_empty(docker_env, instance_id)), instance_id)
