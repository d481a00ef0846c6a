"""Checks for sales-summary; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [line.strip() for line in open("summary.csv").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['region,revenue', 'west,714.68', 'east,635.10', 'south,521.69', 'north,397.00']:
    fail(got)
print("PASS")
