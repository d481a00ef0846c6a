from numkit.chunks import chunks
from numkit.primes import is_prime, primes_below
from numkit.roman import to_roman
from numkit.stats import clamp, mean, median, moving_average


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_moving_average_rejects_empty_window():
    try:
        moving_average([1, 2], 0)
    except ValueError:
        return
    raise AssertionError("no ValueError")


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below():
    assert clamp(-1, 0, 10) == 0


def test_small_primes():
    assert is_prime(2) and is_prime(7) and is_prime(13)
    assert primes_below(2) == []


def test_one_is_not_prime():
    assert not is_prime(1)


def test_roman_small():
    assert to_roman(3) == "III"
    assert to_roman(1000) == "M"


def test_chunks_even():
    assert chunks([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]
