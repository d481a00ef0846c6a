"""Descriptive statistics on plain lists."""


def mean(xs):
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / len(xs)


def median(xs):
    """The middle value; for an even count, the mean of the two middle values."""
    if not xs:
        raise ValueError("median of an empty list")
    s = sorted(xs)
    mid = len(s) // 2
    if len(s) % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def moving_average(xs, k):
    """The mean of every window of ``k`` consecutive values: ``len(xs) - k + 1`` of them."""
    if k < 1:
        raise ValueError("window must be at least 1")
    return [sum(xs[i:i + k]) / k for i in range(len(xs) - k + 1)]


def clamp(x, lo, hi):
    """``x`` limited to ``[lo, hi]``."""
    if lo > hi:
        raise ValueError("lo must not exceed hi")
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
