"""Sequences."""


def flatten(items):
    """Nested lists and tuples as one flat list; strings and bytes are single items."""
    out = []
    for item in items:
        if isinstance(item, (list, tuple)):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out


def dedupe(items):
    """The items without repeats, in the order they first appear."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def group_by(items, key):
    """``key(item)`` -> the items with that key, in order."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def binary_search(sorted_items, target):
    """The index of ``target`` in ``sorted_items``, or -1."""
    lo, hi = 0, len(sorted_items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if sorted_items[mid] == target:
            return mid
        if sorted_items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
