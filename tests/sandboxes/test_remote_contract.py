"""The remote-sandbox behavioural suite against the real services, for each one whose credentials are in
the environment (skipped otherwise, naming the variables to set). Each check creates and removes its own
sandboxes; the TTL is short so a crashed run leaves nothing for long."""

from __future__ import annotations

import os

import pytest
import remote_suite
from sandbox_helpers import run

from miles_agent.registry import load

BACKENDS = {  # backend -> (env vars that must all be set, why)
    "docker": (["MILES_AGENT_TEST_DOCKER"], "set MILES_AGENT_TEST_DOCKER=1 with a reachable Docker engine "
               "(DOCKER_HOST or the local socket) to run against real Docker"),
    "e2b": (["E2B_API_KEY"], "set E2B_API_KEY to run against E2B"),
    "modal": (["MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"], "set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET to run "
              "against Modal"),
    "daytona": (["DAYTONA_API_KEY"], "set DAYTONA_API_KEY (and DAYTONA_API_URL if self-hosted) to run "
                "against Daytona"),
}


def _params():
    for name, (env, why) in BACKENDS.items():
        missing = [v for v in env if not os.environ.get(v)]
        marks = [pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not set: {why}")]
        yield pytest.param(name, marks=marks, id=name)


@pytest.fixture(params=list(_params()))
def make(request):
    cls = load("sandboxes", request.param)
    return lambda: cls(ttl_s=900)


@pytest.mark.timeout(600)
def test_exec_files_env(make):
    run(remote_suite.check_exec_files_env(make))


@pytest.mark.timeout(600)
def test_timeout_kills(make, marker):
    run(remote_suite.check_timeout_kills(make, marker))


@pytest.mark.timeout(600)
def test_output_cap(make):
    run(remote_suite.check_output_cap(make))


@pytest.mark.timeout(600)
def test_exception_and_cancellation_stop_the_sandbox(make):
    run(remote_suite.check_episode_exception_and_cancel_stop(make))
