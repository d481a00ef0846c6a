"""Checks for sort-unique; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = open("sorted.txt").read().splitlines()
except OSError as e:
    fail(e)
if got != ['Ava', 'Elijah', 'Emma', 'Lucas', 'Mia', 'Noah', 'Oliver', 'Olivia', 'Zoe', 'amelia', 'liam']:
    fail(got)
print("PASS")
