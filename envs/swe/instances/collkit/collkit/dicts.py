"""Dictionaries."""


def deep_merge(base, override):
    """A new dict: ``override`` on top of ``base``, nested dicts merged key by key. Inputs are not changed."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
