"""Scoring a patch as SWE-bench does: in a fresh sandbox, the repository at ``base_commit``, the patch
applied (plain, then three-way), the files the test patch touches reset to the base and the test patch
applied, the test files of FAIL_TO_PASS and PASS_TO_PASS run under pytest, each test's outcome read by
node id (`report_plugin`).

SWE-bench's rules: a FAIL_TO_PASS test counts when it passed (or xfailed); skipped, failed, errored or
never run, it does not. A PASS_TO_PASS test counts when it passed, xfailed or was skipped. Reward 1 only
when every one counts. A patch that does not apply, or that edits what the tests stand on (a file of
the test patch, a conftest.py, pytest's config, sitecustomize, a .pth), scores 0 with the reason.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Any

from miles_agent.environment import Reward
from miles_agent.sandbox import Sandbox, SandboxError, SandboxLimits, SandboxSpec

from . import toolkit
from .instance import Instance, patch_paths

WORKDIR = "/testbed"  # where SWE-bench's images keep the repository
HOME = "/opt/miles-swe"
BUNDLE = f"{HOME}/repo.bundle"
REPORT = f"{HOME}/out/report.json"
APPLY_FAILED, TEST_PATCH_FAILED, SETUP_FAILED = 90, 91, 92
FORBIDDEN_NAMES = ("conftest.py", "pytest.ini", "tox.ini", "sitecustomize.py", "usercustomize.py")
F2P_OK, P2P_OK = ("passed", "xfail"), ("passed", "xfail", "skipped")


def python_env(instance: Instance) -> dict[str, str]:
    paths = [toolkit.SITE, *(posixpath.normpath(posixpath.join(WORKDIR, p)) for p in instance.pythonpath)]
    return {"PYTHONPATH": ":".join(paths), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}


def sandbox_spec(instance: Instance, bundle: bytes, *, with_image: bool, extra: dict[str, bytes] | None = None,
                 agent_time_s: float = 600.0) -> SandboxSpec:
    longest = max(agent_time_s, instance.test_timeout_s + 120)
    files = {BUNDLE: bundle, **toolkit.pytest_files(), **(extra or {})}
    return SandboxSpec(image=instance.image if with_image else None, files=files, env=python_env(instance),
                       limits=SandboxLimits(wall_time_s=longest, cpu_time_s=int(longest) * 2), workdir=WORKDIR)


def checkout_script(instance: Instance) -> str:
    """The repository at the base commit in the (empty) workdir, then the instance's setup commands."""
    lines = ["set -e", "git -c init.defaultBranch=main init -q .", f"git fetch -q --no-tags {BUNDLE} base",
             "git reset -q --hard FETCH_HEAD", "git config user.email agent@miles.invalid",
             "git config user.name agent"]
    lines += [f"( {c} ) || exit {SETUP_FAILED}" for c in instance.commands]
    return "\n".join(lines)


def diff_command(base_commit: str) -> str:
    """The agent's work as one patch against the base: every change, new files included, no hooks or
    external diff drivers of the agent's choosing."""
    git = "git -c core.fsmonitor=false -c core.hooksPath=/dev/null"
    return (f"{git} add -A >/dev/null && {git} diff --cached --binary --no-color --no-ext-diff --no-textconv "
            f"--src-prefix=a/ --dst-prefix=b/ {shlex.quote(base_commit)}")


def forbidden_edits(instance: Instance, patch: str) -> list[str]:
    protected = patch_paths(instance.test_patch)
    return sorted(p for p in patch_paths(patch) if p in protected or posixpath.basename(p) in FORBIDDEN_NAMES
                  or p.endswith(".pth"))


def eval_script(instance: Instance, has_patch: bool) -> str:
    base = shlex.quote(instance.base_commit)
    resets = [f"if git cat-file -e {base}:{shlex.quote(p)} 2>/dev/null; then git checkout -q {base} -- "
              f"{shlex.quote(p)}; else rm -rf -- {shlex.quote(p)}; fi" for p in sorted(patch_paths(instance.test_patch))]
    apply = (f"git apply --whitespace=nowarn {HOME}/model.patch 2>&1 || git apply --3way --whitespace=nowarn "
             f"{HOME}/model.patch 2>&1 || exit {APPLY_FAILED}") if has_patch else "true"
    files = " ".join(shlex.quote(f) for f in instance.test_files)
    return "\n".join([
        checkout_script(instance), "set +e", apply, *resets,
        f"git apply --whitespace=nowarn {HOME}/test.patch 2>&1 || exit {TEST_PATCH_FAILED}",
        f"mkdir -p {HOME}/out && rm -f {REPORT}",
        f"MILES_SWE_REPORT={REPORT} python3 -m pytest -p {toolkit.REPORT_PLUGIN} -p no:cacheprovider "
        f"--rootdir={WORKDIR} -q -rN {files}",
        "code=$?", "echo \"[miles-swe: pytest exited $code]\"", "exit $code"])


@dataclass
class Verdict:
    reward: Reward
    reason: str = ""
    tests: dict[str, str] = field(default_factory=dict)  # node id -> outcome ("missing" when never run)
    log: str = ""

    def details(self) -> dict[str, Any]:
        return {"reward_reason": self.reason, "tests": self.tests, "test_log_tail": self.log[-4000:]}


def grade(instance: Instance, outcomes: dict[str, str], exit_code: int) -> Verdict:
    f2p = {t: outcomes.get(t, "missing") for t in instance.fail_to_pass}
    p2p = {t: outcomes.get(t, "missing") for t in instance.pass_to_pass}
    if exit_code not in (0, 1) and not any(v in ("failed", "error") for v in outcomes.values()):
        # pytest did not finish as pytest does (a crash, a forged report, an interpreter that exited early).
        f2p, p2p = {t: "missing" for t in f2p}, {t: "missing" for t in p2p}
    f2p_ok = sum(v in F2P_OK for v in f2p.values())
    p2p_ok = sum(v in P2P_OK for v in p2p.values())
    solved = f2p_ok == len(f2p) and p2p_ok == len(p2p)
    parts = {"fail_to_pass": f2p_ok / len(f2p), "pass_to_pass": p2p_ok / len(p2p) if p2p else 1.0,
             "patch_applied": 1.0}
    bad = [f"{t} {v}" for t, v in f2p.items() if v not in F2P_OK] + \
          [f"{t} {v}" for t, v in p2p.items() if v not in P2P_OK]
    reason = (f"FAIL_TO_PASS {f2p_ok}/{len(f2p)}, PASS_TO_PASS {p2p_ok}/{len(p2p)}"
              + (f"; not passing: {', '.join(bad)}" if bad else ""))
    errors = sorted(k for k, v in outcomes.items() if v == "error" and "::" not in k)
    if errors:
        reason += f"; could not import: {', '.join(errors)}"
    return Verdict(Reward(1.0 if solved else 0.0, parts), reason, {**f2p, **p2p})


def _zero(reason: str, log: str = "", **parts: float) -> Verdict:
    return Verdict(Reward(0.0, {"fail_to_pass": 0.0, "pass_to_pass": 0.0, "patch_applied": 0.0, **parts}), reason,
                   log=log)


async def score_patch(instance: Instance, patch: str, bundle: bytes, sandbox: Sandbox, *,
                      with_image: bool) -> Verdict:
    """Run the evaluation in ``sandbox`` (fresh, unstarted; stopped here) and grade it."""
    forbidden = forbidden_edits(instance, patch)
    if forbidden:
        return _zero(f"the patch edits files the tests stand on ({', '.join(forbidden)}); a fix changes the code",
                     patch_forbidden=1.0)
    files = {f"{HOME}/model.patch": patch.encode(), f"{HOME}/test.patch": instance.test_patch.encode()}
    try:
        await sandbox.start(sandbox_spec(instance, bundle, with_image=with_image, extra=files))
        run = await sandbox.exec(eval_script(instance, bool(patch.strip())), timeout_s=instance.test_timeout_s + 60)
        log = run.stdout + run.stderr
        if run.exit_code == SETUP_FAILED:
            raise SandboxError(f"swe: {instance.instance_id}: an environment_setup command failed: {log[-500:]}")
        if run.exit_code == TEST_PATCH_FAILED:
            raise SandboxError(f"swe: {instance.instance_id}: the test patch does not apply to {instance.base_commit}:"
                               f" {log[-500:]}")
        if run.exit_code == APPLY_FAILED:
            return _zero(f"the patch does not apply to {instance.base_commit[:12]}: {log.strip()[-500:]}", log)
        if run.timed_out:
            return _zero(f"the tests timed out after {instance.test_timeout_s:.0f}s", log, tests_timed_out=1.0)
        try:
            report = json.loads(await sandbox.read_file(REPORT))
            outcomes = {str(k): str(v) for k, v in report["outcomes"].items()}
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            outcomes = {}
        verdict = grade(instance, outcomes, run.exit_code)
        verdict.log = log
        if not outcomes:
            verdict.reason += f"; pytest wrote no report (exit {run.exit_code}): {log.strip()[-500:]}"
        return verdict
    finally:
        await sandbox.stop()
