"""Checks for find-large-files; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [line.strip().removeprefix("./") for line in open("large.txt").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['data/d.bin', 'data/h.bin', 'data/logs/e.log', 'data/logs/old/f.log']:
    fail(got)
print("PASS")
