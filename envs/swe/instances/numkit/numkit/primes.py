"""Primes by trial division."""


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def primes_below(n):
    return [k for k in range(2, n) if is_prime(k)]
