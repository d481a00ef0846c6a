"""Checks for merge-customers; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    got = [line.strip() for line in open("customers.csv").read().splitlines() if line.strip()]
except OSError as e:
    fail(e)
if got != ['email,name,city', 'ana@example.com,Ana,Porto', 'ben@mail.net,Benjamin,London', 'cara@corp.io,Cara,Cork', 'dia@example.com,Dia,Delhi']:
    fail(got)
print("PASS")
