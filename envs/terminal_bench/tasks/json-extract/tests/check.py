"""Checks for json-extract; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [line.strip() for line in open("emails.txt").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['abel@corp.io', 'ines@example.org', 'kofi@corp.io', 'mara@example.org']:
    fail(got)
print("PASS")
