"""A pytest plugin staged into the sandbox: each test's outcome by node id, as JSON, at $MILES_SWE_REPORT.

Outcomes: passed, failed, error (setup or teardown failed, or the file did not import), skipped, xfail,
xpass. Read back by `miles_agent.envs.swe.grading`; runs under the sandbox's Python, stdlib only.
"""

import json
import os

_outcomes = {}


def _set(nodeid, outcome):
    # The worst phase wins: a test that passed its call but failed teardown is an error.
    order = ("passed", "xfail", "skipped", "xpass", "failed", "error")
    if order.index(outcome) >= order.index(_outcomes.get(nodeid, "passed")):
        _outcomes[nodeid] = outcome


def pytest_runtest_logreport(report):
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _set(report.nodeid, "xfail" if report.skipped else "xpass")
        else:
            _set(report.nodeid, report.outcome)
    elif report.failed:
        _set(report.nodeid, "error")
    elif report.skipped:
        _set(report.nodeid, "xfail" if hasattr(report, "wasxfail") else "skipped")


def pytest_collectreport(report):
    if report.failed:
        _set(report.nodeid or "<collection>", "error")


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("MILES_SWE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": _outcomes, "exit_status": int(exitstatus)}, f)
