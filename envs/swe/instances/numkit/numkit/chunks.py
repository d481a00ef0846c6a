"""Splitting sequences."""


def chunks(seq, size):
    """Consecutive pieces of ``size`` items; the last one may be shorter."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [seq[i:i + size] for i in range(0, len(seq), size)]
