"""The Gregorian calendar."""

import datetime

_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year):
    """Every fourth year, except centuries that are not divisible by 400."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if not 1 <= month <= 12:
        raise ValueError("month must be 1..12")
    if month == 2 and is_leap(year):
        return 29
    return _DAYS[month - 1]


def add_months(date, months):
    """The same day ``months`` later (or earlier), moved back to the month's last day when it has fewer."""
    index = date.year * 12 + (date.month - 1) + months
    year, month = divmod(index, 12)
    month += 1
    return datetime.date(year, month, min(date.day, days_in_month(year, month)))
