"""Small text utilities."""

from textkit.case import camel_to_snake, snake_to_camel
from textkit.slug import slugify
from textkit.words import count_words
from textkit.wrap import truncate, wrap

__all__ = ["camel_to_snake", "count_words", "slugify", "snake_to_camel", "truncate", "wrap"]
