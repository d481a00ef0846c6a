"""Small arithmetic helpers."""


def add(a, b):
    return a + b


def divide(a, b):
    """True division; dividing by zero raises ZeroDivisionError."""
    return a // b


def factorial(n):
    """n! for n >= 0."""
    result = 1
    for i in range(1, n):
        result *= i
    return result


def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and spaces."""
    cleaned = text.replace(" ", "")
    return cleaned == cleaned[::-1]
