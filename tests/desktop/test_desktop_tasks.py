"""The desktop env without a desktop: the shipped OSWorld-style tasks, their verifiers' rules, the tool calls."""

from __future__ import annotations

import pytest

from miles_agent import registry
from miles_agent.environment import ToolError
from miles_agent.envs.desktop.actions import a11y_text, find_target, parse_action
from miles_agent.envs.desktop.desktop import Observation
from miles_agent.envs.desktop.env import DesktopEnv
from miles_agent.envs.desktop.tasks import Check, judge, load_tasks, parse_task
from miles_agent.errors import UserError


def test_the_shipped_tasks_are_registered_and_each_has_an_oracle_and_a_verifier():
    env_cls = registry.load("envs", "desktop")
    assert env_cls is DesktopEnv
    tasks = load_tasks()
    assert len(tasks) >= 10
    apps = {a for t in tasks for a in t.related_apps}
    assert {"chromium", "terminal", "mousepad"} <= apps
    for t in tasks:
        assert t.oracle and t.checks and t.launch, t.id
    web = [t for t in tasks if t.webapp]
    assert web and all(c.result["path"].startswith("/var/lib/miles-webapp/") for t in web for c in t.checks)


def test_an_osworld_task_with_an_unsupported_part_is_refused_by_name():
    base = {"id": "x", "instruction": "do", "config": [], "evaluator": {
        "func": "exact_match", "result": {"type": "vm_file", "path": "/a"}, "expected": {"type": "rule", "rules": {}}}}
    assert parse_task(base).checks[0].func == "exact_match"
    with pytest.raises(UserError, match="config step type 'download'"):
        parse_task({**base, "config": [{"type": "download", "parameters": {}}]})
    with pytest.raises(UserError, match="func 'compare_pptx_files'"):
        parse_task({**base, "evaluator": {**base["evaluator"], "func": "compare_pptx_files"}})
    with pytest.raises(UserError, match="has no 'evaluator'"):
        parse_task({"id": "x", "instruction": "do"})
    launched = parse_task({**base, "config": [{"type": "launch", "parameters": {"command": [
        "google-chrome", "--remote-debugging-port=1337", "http://127.0.0.1:8765/todo"]}}]})
    assert launched.launch == (("browser", "http://127.0.0.1:8765/todo"),) and launched.webapp


def test_verifier_rules():
    def check(func: str, **rules: object) -> Check:
        return Check(func, {"type": "vm_file", "path": "/a"}, rules)

    assert judge(check("check_json", expect={"a": 1}), '{"a": 1, "b": 2}') == 1.0
    assert judge(check("check_json", expect={"a": 1}), '{"a": 2}') == 0.0
    assert judge(check("check_json", expect={"a": 1}), "") == 0.0  # no record: nothing was submitted
    assert judge(check("check_text_lines", lines=["x", "y"]), "x\n\ny\n") == 1.0
    assert judge(check("check_text_lines", lines=["x", "y"]), "x\n") == 0.0
    assert judge(check("check_include_exclude", include=["ok"], exclude=["err"]), "ok done") == 1.0
    assert judge(check("check_include_exclude", include=["ok"], exclude=["err"]), "ok err") == 0.0
    assert judge(check("exact_match", expected="yes"), "yes\n") == 1.0


def test_tool_calls_are_checked_before_they_reach_the_desktop():
    assert parse_action("click", {"x": 10, "y": 20}, 1024, 768) == {"action": "click", "x": 10, "y": 20, "button": "left"}
    assert parse_action("key", {"keys": "ctrl+s"}, 1024, 768)["keys"] == "ctrl+s"
    assert parse_action("drag", {"x": 1, "y": 2, "x2": 3, "y2": 4}, 1024, 768)["x2"] == 3
    for name, args, message in [
        ("click", {"x": 2000, "y": 1}, "off the screen"),
        ("click", {"x": "10", "y": 1}, "must be an integer"),
        ("key", {"keys": "ctrl+s; rm -rf /"}, "key names"),
        ("type", {"text": ""}, "non-empty"),
        ("scroll", {"x": 1, "y": 1, "direction": "sideways"}, "direction"),
        ("wait", {"seconds": 99}, "0 to 10"),
        ("teleport", {}, "unknown tool"),
    ]:
        with pytest.raises(ToolError, match=message):
            parse_action(name, args, 1024, 768)


def test_the_text_observation_gives_each_element_its_centre():
    obs = Observation(windows=[{"name": "Contact us", "x": 0, "y": 0, "w": 1024, "h": 768, "focused": True}],
                      a11y=[{"role": "button", "name": "Send", "depth": 3, "x": 20, "y": 300, "w": 80, "h": 30},
                            {"role": "textbox", "name": "Name", "depth": 4, "x": 70, "y": 160, "w": 300, "h": 24,
                             "value": "Ada"}])
    text = a11y_text(obs, 1024, 768)
    assert 'button "Send" at (60,315)' in text and "value='Ada'" in text and "(focused)" in text
    assert find_target(obs, {"role": "button", "name": "Send"}) == (60, 315)
    assert find_target(obs, {"window": "Contact"}) == (512, 384)
    with pytest.raises(LookupError, match="no element"):
        find_target(obs, {"role": "button", "name": "Cancel"})


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="too small"):
        DesktopEnv(width=100, height=100)
    with pytest.raises(UserError, match="does not exist"):
        DesktopEnv(tasks_dir="/nonexistent/tasks")
