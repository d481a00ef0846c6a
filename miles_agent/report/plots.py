"""The report's plots, one PNG each, drawn from the step records of ``metrics.jsonl`` (schema: docs/metrics.md).

A plot whose metrics the run did not record is still drawn, as a panel saying so, so the page
layout never depends on which parts of the pipeline a run used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOT_RECORDED = "not recorded in this run"
Records = list[dict[str, Any]]


@dataclass
class Plot:
    name: str  # file stem and HTML anchor
    title: str
    recorded: bool  # False: the PNG is the "not recorded" panel
    path: Path


def series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry a finite ``key``."""
    pts = [(int(r["step"]), float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [s for s, _ in pts], [v for _, v in pts]


def keys_with(records: Records, prefix: str) -> list[str]:
    return sorted({k for r in records for k in r if k.startswith(prefix)})


def _reward(ax: Any, records: Records) -> bool:
    steps, mean = series(records, "reward_mean")
    if not steps:
        return False
    std = dict(zip(*series(records, "reward_std")))
    lo = [m - std.get(s, 0.0) for s, m in zip(steps, mean)]
    hi = [m + std.get(s, 0.0) for s, m in zip(steps, mean)]
    ax.fill_between(steps, lo, hi, alpha=0.25, color="tab:blue", label="± std over episodes")
    ax.plot(steps, mean, color="tab:blue", marker="o", ms=3, label="mean reward")
    for key in keys_with(records, "reward/"):
        ax.plot(*series(records, key), lw=1, ls="--", label=key)
    ax.set_ylabel("reward")
    return True


def _length(ax: Any, records: Records) -> bool:
    steps, mean = series(records, "response_len")
    if not steps:
        return False
    lo, hi = dict(zip(*series(records, "response_len_min"))), dict(zip(*series(records, "response_len_max")))
    if lo and hi:
        band = [s for s in steps if s in lo and s in hi]
        ax.fill_between(band, [lo[s] for s in band], [hi[s] for s in band], alpha=0.2, color="tab:green",
                        label="min-max")
    ax.plot(steps, mean, color="tab:green", marker="o", ms=3, label="mean response tokens")
    ax.set_ylabel("tokens")
    return True


PHASES = ("time/rollout", "time/train", "time/sync")


def _step_time(ax: Any, records: Records) -> bool:
    phases = [k for k in PHASES if series(records, k)[0]]
    phases += [k for k in keys_with(records, "time/") if k not in PHASES and k != "time/step"]
    rows = [r for r in records if all(isinstance(r.get(k), (int, float)) for k in phases)] if phases else []
    if not rows:
        return False
    steps = [int(r["step"]) for r in rows]
    ax.stackplot(steps, *[[float(r[k]) for r in rows] for k in phases], labels=[k[5:] for k in phases],
                 alpha=0.8)
    ax.set_ylabel("seconds per step")
    return True


def _mismatch(ax: Any, records: Records) -> bool:
    drawn = False
    for key, label in (("train/logprob_mismatch_mean", "mean |Δ logprob|"),
                       ("train/logprob_mismatch_max", "max |Δ logprob|")):
        steps, vals = series(records, key)
        if steps:
            ax.plot(steps, [max(v, 1e-12) for v in vals], marker="o", ms=3, label=label)
            drawn = True
    if drawn:
        ax.set_yscale("log")
        ax.set_ylabel("trainer vs rollout logprob")
    return drawn


def _staleness(ax: Any, records: Records) -> bool:
    counts: dict[int, float] = {}
    for key in keys_with(records, "staleness/hist/"):
        counts[int(key.rsplit("/", 1)[1])] = sum(series(records, key)[1])
    if not counts:
        return False
    lags = sorted(counts)
    ax.bar([str(k) for k in lags], [counts[k] for k in lags], color="tab:purple")
    ax.set_xlabel("weight versions behind the trainer")
    ax.set_ylabel("episodes (all steps)")
    return True


def _failures(ax: Any, records: Records) -> bool:
    keys = keys_with(records, "failures/")
    if not keys:
        return False
    for key in keys:
        ax.plot(*series(records, key), marker="o", ms=3, label=key.split("/", 1)[1])
    ax.set_ylabel("count per step")
    return True


def _losses(ax: Any, records: Records) -> bool:
    keys = [k for k in ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/approx_kl")
            if series(records, k)[0]]
    for key in keys:
        ax.plot(*series(records, key), marker="o", ms=3, label=key.split("/", 1)[1])
    return bool(keys)


def _grad_norm(ax: Any, records: Records) -> bool:
    steps, vals = series(records, "train/grad_norm")
    if steps:
        ax.plot(steps, vals, marker="o", ms=3, color="tab:red", label="grad norm (before clipping)")
    return bool(steps)


PLOTS: list[tuple[str, str, Callable[[Any, Records], bool]]] = [
    ("reward", "Reward (mean ± std over the step's episodes)", _reward),
    ("response_length", "Response length", _length),
    ("step_time", "Step time by phase (stacked)", _step_time),
    ("mismatch", "Trainer / rollout logprob mismatch", _mismatch),
    ("staleness", "Staleness of trained episodes", _staleness),
    ("failures", "Failures and retries", _failures),
    ("losses", "Loss terms", _losses),
    ("grad_norm", "Gradient norm", _grad_norm),
]


def draw_all(records: Records, out_dir: Path) -> list[Plot]:
    """Every plot as ``out_dir/NAME.png``; a plot without data becomes the "not recorded" panel."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, never a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, title, draw in PLOTS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        try:
            recorded = draw(ax, records)
            if recorded:
                if not ax.get_xlabel():
                    ax.set_xlabel("step")
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7, loc="best")
            else:
                ax.clear()
                ax.set_axis_off()
                ax.text(0.5, 0.5, NOT_RECORDED, ha="center", va="center", fontsize=14, color="0.4",
                        transform=ax.transAxes)
            ax.set_title(title, fontsize=10)
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path)
        finally:
            plt.close(fig)
        plots.append(Plot(name, title, recorded, path))
    return plots
