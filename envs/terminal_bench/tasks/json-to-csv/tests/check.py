"""Checks for json-to-csv; exit 0 = pass."""
import csv
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


try:
    rows = list(csv.reader(open("inventory.csv", newline="")))
except OSError as e:
    fail(e)
if not rows or rows[0] != ["name", "qty", "price"]:
    fail(rows[:1])
want = [('bolt', 120, 0.15), ('nut', 300, 0.05), ('hammer', 8, 12.5), ('saw', 3, 24), ('drill bit', 40, 3.75)]
try:
    got = [(r[0], int(r[1]), float(r[2])) for r in rows[1:] if r]
except (ValueError, IndexError) as e:
    fail(e)
if got != want:
    fail(got)
print("PASS")
