"""Helpers for lists and dicts."""
