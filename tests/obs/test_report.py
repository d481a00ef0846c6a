"""`miles-agent report` on a real run of the main job: the page, its plots, sample trajectories with
loss-masked spans set apart, checked in a real headless Chromium (no console errors, every image loaded)."""

from __future__ import annotations

import json
import re
from html import escape

import pytest

from miles_agent.cli import main
from miles_agent.errors import UserError
from miles_agent.report import build_report
from miles_agent.report.plots import NOT_RECORDED, PLOTS
from miles_agent.report.trajectories import render_trajectory
from miles_agent.types import Trajectory

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def main_job_run(tmp_path_factory):
    """`miles-agent train --env arith-tools --recipe tiny-cpu` for 3 steps (2 tasks x 8 samples a step to keep
    CI quick; the full 8-task batch takes ~4x longer), then `miles-agent report`."""
    run_dir = tmp_path_factory.mktemp("tiny-cpu")
    assert main(["train", "--env", "arith-tools", "--recipe", "tiny-cpu", "--run-dir", str(run_dir),
                 "--no-progress", "run.steps=3", "rollout.prompts_per_step=2", "run.sinks=tensorboard"]) == 0
    assert main(["report", str(run_dir)]) == 0
    return run_dir


def test_report_has_every_plot_and_sample_trajectories(main_job_run):
    page = main_job_run / "report" / "report.html"
    text = page.read_text()
    for name, _title, _ in PLOTS:
        png = main_job_run / "report" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG, name
        assert f"src='plots/{name}.png'" in text
    # everything the main job measures is plotted, nothing claims to be missing
    assert NOT_RECORDED not in text
    records = [json.loads(line) for line in (main_job_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert sum(r["staleness/hist/0"] for r in records) == 3 * 16  # synchronous loop: all on-policy
    assert "<tr><th>steps recorded</th><td>3</td></tr>" in text
    # samples: 2 per step, decoded with the run's exported tokenizer, newest step first
    steps = [int(s) for s in re.findall(r"<h3>step (\d+) ", text)]
    assert steps == [2, 2, 1, 1, 0, 0]
    assert "final/tokenizer.json" in text
    # the model's tool call is shown as text (escaped), never as markup
    assert "&lt;tool_call&gt;" in text and "<tool_call>" not in text
    assert "class='trained model'" in text and "class='masked observation'" in text


def test_the_loop_feeds_the_configured_sink(main_job_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(main_job_run / "tensorboard"))
    acc.Reload()
    records = [json.loads(line) for line in (main_job_run / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "train/loss", "time/step", "failures/episode_retries", "staleness/mean"):
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key


def test_report_renders_in_a_real_browser(main_job_run):
    pytest.importorskip("websockets")
    from headless_browser import Browser, chromium_path, file_url

    binary = chromium_path()
    if binary is None:
        pytest.skip("chromium is not installed (.ci/run installs it with apt-get install chromium)")
    browser = Browser(binary)
    try:
        browser.open(file_url(main_job_run / "report" / "report.html"))
        images = browser.evaluate(
            "Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
        assert len(images) == len(PLOTS)
        assert all(complete and width > 0 for _, complete, width in images), images
        assert browser.errors() == []
        shown = browser.evaluate("""(() => {
            const t = document.querySelector('span.trained'), m = document.querySelector('span.masked');
            return {trained: getComputedStyle(t).backgroundColor, masked: getComputedStyle(m).backgroundColor,
                    sections: document.querySelectorAll('section.trajectory').length,
                    injected: document.querySelectorAll('tool_call, tool_response, answer').length,
                    call: t.textContent}; })()""")
        assert shown["trained"] != shown["masked"]  # the loss-masked spans look different
        assert shown["sections"] == 6 and shown["injected"] == 0
        assert shown["call"]  # decoded text, not ids
    finally:
        browser.close()


def test_missing_metrics_become_not_recorded_panels(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward_mean": r}) + "\n" for s, r in enumerate([0.1, 0.4])))
    page = build_report(tmp_path).read_text()
    for name in ("reward",):
        assert f"<figcaption>{escape(dict((n, t) for n, t, _ in PLOTS)[name])}</figcaption>" in page
    for name in ("mismatch", "staleness", "failures", "step_time", "response_length", "losses", "grad_norm"):
        title = dict((n, t) for n, t, _ in PLOTS)[name]
        assert f"<figcaption>{escape(title)}: {NOT_RECORDED}</figcaption>" in page
        assert (tmp_path / "report" / "plots" / f"{name}.png").read_bytes()[:8] == PNG
    assert f"{NOT_RECORDED}: no samples.jsonl" in page


def test_report_of_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        build_report(tmp_path)
    assert main(["report", str(tmp_path / "nope")]) == 2


def test_decoded_text_is_escaped_and_masks_split_spans(tokenizer):
    traj = Trajectory(prompt_ids=[1, 2])
    traj.append_model([10, 11], [-0.1, -0.2], weight_version=4, turn=0)
    traj.append_observation([12], turn=0)
    traj.append_model([13, 14], [-0.1, -0.1], weight_version=4, turn=1, trainable=False)
    traj.reward = 1.0
    names = {1: "sys", 2: "<b>", 10: "<script>", 11: "x'\"", 12: "&obs", 13: "cut", 14: "off"}
    html = render_trajectory(traj, lambda ids: "".join(names[i] for i in ids), step=7, advantages=[0.5] * 5)
    assert "<script>" not in html and "&lt;script&gt;x&#x27;&quot;" in html and "&lt;b&gt;" in html
    assert "<span class='trained model' data-kind='model' data-mask='1'" in html
    assert "data-kind='observation' data-mask='0'" in html and ">&amp;obs</span>" in html
    # a model span the trainer must not learn from (loss mask 0) is shown masked, not trained
    assert "<span class='masked model' data-kind='model' data-mask='0'" in html and ">cutoff</span>" in html
    assert "advantage +0.500" in html and "turn 1 (2 sampled tokens)" in html


def test_screenshots_show_inline_where_their_placeholders_are():
    import base64 as b64

    from miles_agent.report.trajectories import _decoder
    from miles_agent.types import ImageInput
    from tests.desktop.test_trajectory_images import png

    first, second = png(4, 3, 10), png(2, 2, 200)
    traj = Trajectory(prompt_ids=[1, 9, 9, 2], images=[ImageInput(1, 3, 9, first)])
    traj.append_model([5], [-0.1], weight_version=0, turn=0)
    traj.append_observation([6, 9, 9, 9], turn=1, images=[ImageInput(1, 4, 9, second)])
    traj.append_model([7], [-0.1], weight_version=0, turn=1)
    traj.reward = 0.0
    html = render_trajectory(traj.validate(), lambda ids: " ".join(map(str, ids)), step=0, advantages=None)
    import re

    prompt, turn0, turn1 = re.split(r"<div class='turn(?: prompt)?'>", html)[1:]
    assert b64.b64encode(first).decode() in prompt and "image 0: 4x3, tokens 1-3" in prompt
    assert "<img" not in turn0
    assert b64.b64encode(second).decode() in turn1 and "image 1: 2x2, tokens 6-9" in turn1

    from miles_agent.models.tokenizer import build_byte_tokenizer

    tok = build_byte_tokenizer(vision=True)
    ids = tok.encode("a<|vision_start|>" + "<|image_pad|>" * 54 + "<|vision_end|>b", add_special_tokens=False)
    assert _decoder(tok)(ids) == "a<|vision_start|><|image_pad|>x54<|vision_end|>b"
