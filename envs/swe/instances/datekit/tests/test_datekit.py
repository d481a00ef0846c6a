import datetime

from datekit.calendar import add_months, days_in_month, is_leap
from datekit.duration import format_duration, parse_duration


def test_ordinary_leap_years():
    assert is_leap(2024) and not is_leap(2023)


def test_days_in_april():
    assert days_in_month(2023, 4) == 30


def test_add_one_month_midyear():
    assert add_months(datetime.date(2023, 5, 10), 1) == datetime.date(2023, 6, 10)


def test_parse_minutes():
    assert parse_duration("5m") == 300


def test_format_hours_and_minutes():
    assert format_duration(5400) == "1h30m"


def test_parse_rejects_garbage():
    try:
        parse_duration("ten minutes")
    except ValueError:
        return
    raise AssertionError("no ValueError")
