"""A third-party environment package runs our environment contract against itself, in its own pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "thirdparty_env"


def test_a_thirdparty_package_runs_the_contract_on_its_environment(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FIXTURE / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(FIXTURE),
                        "contract_check.py"], cwd=FIXTURE, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "3 passed" in r.stdout, r.stdout[-2000:]


def test_the_env_side_suites_import_without_torch():
    """An environment's author may test on a CPU-only node without torch (as the env side runs)."""
    script = ("import sys; sys.modules['torch'] = None\n"
              "from miles_agent.testing.contracts import EnvironmentContract, SandboxContract\n"
              "print(EnvironmentContract.__name__, SandboxContract.__name__)")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_suite_whose_subclass_names_no_plugin_fails_with_the_fix(tmp_path):
    """Forgetting the fixture is a usage error with a message, not a pass and not a bare traceback."""
    (tmp_path / "test_forgot.py").write_text(
        "from miles_agent.testing.contracts import SandboxContract\n\n\nclass TestForgot(SandboxContract):\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                        "test_forgot.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and " passed" not in r.stdout, r.stdout[-2000:]
    assert "define `@pytest.fixture def make_sandbox(self)`" in r.stdout, r.stdout[-2000:]
