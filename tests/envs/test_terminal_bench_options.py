"""terminal-bench takes its options from the command line (env.options.KEY=VALUE), typed and checked."""

import pytest

from miles_agent import build
from miles_agent.config import load_config
from miles_agent.errors import UserError


def test_terminal_bench_options_reach_the_env():
    cfg = load_config(None, ["env.name=terminal-bench", "env.options.verifier_toolchain=none", "env.options.command_timeout_s=5"])
    env = build.build_env(cfg)
    assert env.toolchain is None and env.command_timeout_s == 5.0

def test_terminal_bench_unknown_option_names_the_valid_ones():
    cfg = load_config(None, ["env.name=terminal-bench", "env.options.verifier_tolchain=none"])
    with pytest.raises(UserError, match="verifier_toolchain"):
        build.check_choices(cfg)
