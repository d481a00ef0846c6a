"""Checks for append-line; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    lines = open("log.txt").read().splitlines()
except OSError as e:
    fail(e)
if lines != ["started", "loading", "running", "done"]:
    fail(lines)
print("PASS")
