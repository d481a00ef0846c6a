"""Calendar and duration helpers."""
