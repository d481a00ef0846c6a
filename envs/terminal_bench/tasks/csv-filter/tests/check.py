"""Checks for csv-filter; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = open("adults.csv").read().splitlines()
except OSError as e:
    fail(e)
if got != ['name,age,city', 'Ana,34,Lisbon', 'Chloe,30,Lyon', 'Eve,41,Oslo', 'Gia,30,Rome', 'Hugo,55,Porto', 'Jon,31,Bergen']:
    fail(got)
print("PASS")
