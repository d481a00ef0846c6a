"""Sample trajectories as HTML, turn by turn: what the model sampled (trained on) set apart from what
it was shown (loss-masked), decoded with the run's own tokenizer. Every decoded string is escaped.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_agent.types import SpanKind, Trajectory

Decode = Callable[[list[int]], str]


def find_tokenizer(run_dir: Path) -> tuple[Decode, str]:
    """(decode, where it came from): the run's exported model, its configured checkpoint or warm start,
    the built-in byte tokenizer for tiny architectures, else raw ids."""
    run_dir = Path(run_dir)
    cfg: dict[str, Any] = {}
    if (run_dir / "config.json").is_file():
        try:
            cfg = json.loads((run_dir / "config.json").read_text(errors="replace")).get("model", {})
        except ValueError:  # torn by a crash (the summary says so): the run's final/ tokenizer, else raw ids
            pass
    for folder in (run_dir / "final", cfg.get("hf_checkpoint"), cfg.get("warm_start")):
        if folder and (Path(folder) / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            path = Path(folder) / "tokenizer.json"
            return _decoder(Tokenizer.from_file(str(path))), str(path)
    if str(cfg.get("arch", "tiny-qwen3")).startswith("tiny-"):
        from miles_agent.models.builder import TINY_ARCHS
        from miles_agent.models.tokenizer import build_byte_tokenizer

        vision = "vision_config" in TINY_ARCHS.get(str(cfg.get("arch", "")), {})  # a VLM's image markers
        return _decoder(build_byte_tokenizer(vision=vision)), "the built-in byte tokenizer"  # what tiny models use
    return (lambda ids: " ".join(map(str, ids))), "none found (showing token ids)"


def _decoder(tok: Any) -> Decode:
    pads = re.compile(r"(?:<\|image_pad\|>)+")  # an image's placeholder run, shown as one marker and its length
    return lambda ids: pads.sub(lambda m: f"<|image_pad|>x{len(m.group()) // 13}",
                                tok.decode(ids, skip_special_tokens=False))


def _screens(traj: Trajectory, where: Callable[[int], bool]) -> str:
    """The trajectory's images whose placeholders start where ``where(start)`` holds, inline as PNGs."""
    shots = [f"<figure class='screen'><img alt='image {k}' src='data:image/png;base64,"
             f"{base64.b64encode(im.data).decode()}' width='{min(im.width, 480)}'><figcaption>image {k}: "
             f"{im.width}x{im.height}, tokens {im.start}-{im.end}</figcaption></figure>"
             for k, im in enumerate(traj.images) if where(im.start)]
    return "".join(shots)


def _runs(mask: list[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """Split ``[start, end)`` into runs of equal loss-mask value: (start, end, mask)."""
    out: list[tuple[int, int, int]] = []
    for i in range(start, end):
        if out and out[-1][2] == mask[i] and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1, mask[i])
        else:
            out.append((i, i + 1, mask[i]))
    return out


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def render_trajectory(traj: Trajectory, decode: Decode, step: int, advantages: list[float] | None) -> str:
    """One trajectory as a <section>: header, the prompt, then each turn's spans. Trained tokens get
    class ``trained``, loss-masked ones ``masked``."""
    response = traj.response_ids
    adv = f"{advantages[0] if advantages and any(traj.loss_mask) else 0.0:+.3f}" if advantages else "not trained"
    reward = "-" if traj.reward is None else f"{traj.reward:.3f}"
    parts = ", ".join(f"{_esc(k)} {v:.2f}" for k, v in sorted(traj.reward_parts.items()))
    head = (f"<h3>step {step} &middot; task {_esc(traj.task_id)} &middot; {_esc(traj.status.value)} &middot; "
            f"reward {reward}{' (' + parts + ')' if parts else ''} &middot; advantage {adv}</h3>")
    if traj.metadata.get("error"):
        head += f"<p class='error'>error: {_esc(str(traj.metadata['error']))}</p>"
    body = [f"<div class='turn prompt'><div class='turn-label'>prompt ({len(traj.prompt_ids)} tokens, "
            f"masked)</div><pre class='masked'>{_esc(decode(traj.prompt_ids))}</pre>"
            f"{_screens(traj, lambda s: s < len(traj.prompt_ids))}</div>"]
    turns: dict[int, list[str]] = {}
    for span in traj.spans:
        for a, b, m in _runs(traj.loss_mask, span.start, span.end):
            cls = "trained" if m else "masked"
            version = f", weights v{span.weight_version}" if span.weight_version is not None else ""
            tip = f"{span.kind.value}: {b - a} tokens, {'trained' if m else 'loss-masked'}{version}"
            turns.setdefault(span.turn, []).append(
                f"<span class='{cls} {span.kind.value}' data-kind='{span.kind.value}' data-mask='{m}' "
                f"title='{_esc(tip)}'>{_esc(decode(response[a:b]))}</span>")
    n = len(traj.prompt_ids)
    for turn, pieces in sorted(turns.items()):
        n_model = sum(s.end - s.start for s in traj.spans if s.turn == turn and s.kind is SpanKind.MODEL)
        spans = [(n + s.start, n + s.end) for s in traj.spans if s.turn == turn]
        shots = _screens(traj, lambda p, spans=spans: any(a <= p < b for a, b in spans))
        body.append(f"<div class='turn'><div class='turn-label'>turn {turn} ({n_model} sampled tokens)</div>"
                    f"<pre>{''.join(pieces)}</pre>{shots}</div>")
    return f"<section class='trajectory' data-status='{_esc(traj.status.value)}'>{head}{''.join(body)}</section>"


def render_samples(samples: list[dict[str, Any]], decode: Decode, limit: int = 12) -> list[str]:
    """The most recent steps' samples first, at most ``limit`` trajectories."""
    ordered = sorted(samples, key=lambda d: -int(d.get("step", 0)))[:limit]
    return [render_trajectory(Trajectory.from_dict(d), decode, int(d.get("step", 0)), d.get("advantages"))
            for d in ordered]
