"""``miles-agent report RUN_DIR``: one static HTML page with PNG plots and sample trajectories.

Reads only files the run wrote (``metrics.jsonl``, ``config.json``, ``samples.jsonl`` or
``rollouts/``, the exported tokenizer), so it works on a finished run, a running one, or a copy of
either. Needs matplotlib (``pip install 'miles-agent[report]'``).
"""

from __future__ import annotations

import html
import json
import logging
import math
from pathlib import Path
from typing import Any

from miles_agent.errors import UserError, require
from miles_agent.evaluate import FAILURE_PARTS
from miles_agent.metrics import read_jsonl

log = logging.getLogger(__name__)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1400px; color: #222; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1em; }
figure { margin: 0; border: 1px solid #ddd; padding: .5em; }
figure img { width: 100%; height: auto; }
figcaption { font-size: .85em; color: #555; }
table { border-collapse: collapse; font-size: .85em; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
section.trajectory { border: 1px solid #ccc; margin: 1em 0; padding: .5em 1em; }
section.trajectory h3 { font-size: 1em; }
pre { white-space: pre-wrap; word-break: break-word; font-size: .85em; margin: .2em 0; }
.turn-label { font-size: .75em; color: #666; margin-top: .5em; }
.trained { background: #d9f2d9; border-bottom: 2px solid #2e8b2e; }
.masked { background: #eeeeee; color: #666; }
.observation.masked { font-style: italic; }
.legend span { padding: 0 .5em; margin-right: 1em; }
.error { color: #b00; }
"""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return html.escape(str(v))


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir} has no metrics.jsonl; point `miles-agent report` at a run directory "
                        "(the train command's --run-dir)")
    if not (records := read_jsonl(path)):  # a torn last line (a crash mid-write) is dropped, with a warning
        raise UserError(f"{path} holds no finished step yet (a run logs one line per step); report again after "
                        "the run's first step")
    return records


def _summary(run_dir: Path, records: list[dict[str, Any]]) -> str:
    cfg = {}
    if (run_dir / "config.json").is_file():
        try:
            cfg = json.loads((run_dir / "config.json").read_text(errors="replace"))
        except ValueError:  # torn by a crash: the summary goes without it
            log.warning("%s is not JSON; the summary leaves out the run's settings", run_dir / "config.json")
    rows = [("run directory", str(run_dir)), ("steps recorded", str(len(records)))]
    if cfg:
        rows += [("environment", cfg["env"]["name"]), ("model", cfg["model"].get("hf_checkpoint") or cfg["model"]["arch"]),
                 ("batch", f"{cfg['rollout']['prompts_per_step']} prompts × {cfg['rollout']['samples_per_prompt']} samples"),
                 ("algorithm", f"{cfg['algo']['advantage']} / {cfg['algo']['loss']}, lr {cfg['train']['lr']}")]
    rewards = [r["reward_mean"] for r in records if isinstance(r.get("reward_mean"), (int, float))]
    if rewards:
        rows.append(("reward, first → last step", f"{rewards[0]:.3f} → {rewards[-1]:.3f}"))
    if zeros := zero_reasons(records):
        rows.append(("rewards below 1, why (share of scored episodes, run mean)", zeros))
    total = sum(float(r.get("time/step", 0.0)) for r in records)
    if total:
        rows.append(("time in steps", f"{total:.1f} s"))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def zero_reasons(records: list[dict[str, Any]]) -> str:
    """The verifier-side reasons of rewards below 1 (parts such as verifier_timed_out), and the episodes
    refused for a reward outside the environment's range."""
    shares = {p: [float(r.get(f"reward/{p}", 0.0)) for r in records] for p in (*FAILURE_PARTS, "reward_clipped")}
    out = [f"{p} {sum(v) / len(records):.1%}" for p, v in shares.items() if any(v)]
    refused = max((float(r.get("episode_reward_out_of_range", 0)) for r in records), default=0.0)
    return ", ".join(out + ([f"reward out of range: {refused:.0f} episodes"] if refused else []))


def _last_step_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "<p>no steps recorded yet</p>"
    last = records[-1]
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(v)}</td></tr>" for k, v in last.items())
    return f"<details><summary>every metric of step {_fmt(last.get('step'))}</summary><table>{body}</table></details>"


def build_report(run_dir: Path, out_dir: Path | None = None, max_samples: int = 12) -> Path:
    """Write ``report.html`` and ``plots/*.png`` into ``out_dir`` (default ``RUN_DIR/report``); returns the page."""
    require("matplotlib", "report", "miles-agent report")
    from miles_agent.dumps import read_samples
    from miles_agent.report.plots import NOT_RECORDED, draw_all
    from miles_agent.report.trajectories import find_tokenizer, render_samples

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder; pass the run directory (the train command's --run-dir)")
    out_dir = Path(out_dir) if out_dir else run_dir / "report"
    records = read_records(run_dir)
    plots = draw_all(records, out_dir / "plots")
    figures = "".join(
        f"<figure id='{p.name}'><img src='plots/{p.path.name}' alt='{html.escape(p.title)}'>"
        f"<figcaption>{html.escape(p.title)}{'' if p.recorded else ': ' + NOT_RECORDED}</figcaption></figure>"
        for p in plots)
    decode, tokenizer_source = find_tokenizer(run_dir)
    samples = read_samples(run_dir)
    trajs = render_samples(samples, decode, max_samples)
    traj_html = "".join(trajs) if trajs else (
        f"<p>{NOT_RECORDED}: no samples.jsonl or rollouts/ (set run.log_samples or run.dump_rollouts)</p>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>miles-agent report: {html.escape(run_dir.name)}</title>
<link rel="icon" href="data:,"><style>{STYLE}</style></head>
<body>
<h1>Run report: {html.escape(run_dir.name)}</h1>
{_summary(run_dir, records)}
{_last_step_table(records)}
<h2>Metrics</h2>
<div class="grid">{figures}</div>
<h2>Sample trajectories</h2>
<p class="legend"><span class="trained">sampled by the policy, trained on</span>
<span class="masked">shown to the policy, loss-masked</span>
decoded with {html.escape(tokenizer_source)}; most recent steps first.</p>
{traj_html}
</body></html>
"""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
