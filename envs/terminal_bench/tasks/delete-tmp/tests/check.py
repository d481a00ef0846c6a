"""Checks for delete-tmp; exit 0 = pass."""
import os
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


found = sorted(os.path.join(d, f) for d, _, fs in os.walk("cache") for f in fs)
if found != ["cache/keep.dat", "cache/notes.txt", "cache/sub/data.tmp.bak"]:
    fail(found)
if not os.path.isfile("top.tmp"):
    fail("top.tmp (outside cache/) was deleted")
print("PASS")
