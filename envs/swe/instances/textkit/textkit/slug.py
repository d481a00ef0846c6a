"""URL slugs."""

import re


def slugify(text, sep="-"):
    """Lowercase ASCII letters and digits, every other run of characters one ``sep``, none at the ends."""
    slug = re.sub(r"[^a-z0-9]+", sep, text.lower())
    return slug.strip(sep)
