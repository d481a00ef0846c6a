"""Checks for log-error-counts; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [" ".join(line.split()) for line in open("errors.txt").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['db 12', 'auth 7', 'api 4', 'cache 2']:
    fail(got)
print("PASS")
