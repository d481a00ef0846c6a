"""Durations written as ``1h30m15s``."""

import re

_PART = re.compile(r"(\d+)([hms])")
_UNIT = {"h": 3600, "m": 60, "s": 1}


def parse_duration(text):
    """``"1h30m"`` -> 5400 seconds. Units h, m, s, each at most once, in that order."""
    text = text.strip()
    if not text or not re.fullmatch(r"(\d+h)?(\d+m)?(\d+s)?", text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * _UNIT[u] for n, u in _PART.findall(text))


def format_duration(seconds):
    """5400 -> ``"1h30m"``: the non-zero units, largest first; zero is ``"0s"``."""
    if seconds < 0:
        raise ValueError("negative duration")
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    out = "".join(f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v)
    return out or "0s"
