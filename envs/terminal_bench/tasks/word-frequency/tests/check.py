"""Checks for word-frequency; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [" ".join(line.split()) for line in open("top3.txt").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['the 118', 'cat 74', 'a 45']:
    fail(got)
print("PASS")
