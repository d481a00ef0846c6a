"""Checks for fix-median-bug; exit 0 = pass."""
import subprocess
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


for case, want in {'odd.txt': '5', 'even.txt': '6', 'neg.txt': '1.25', 'one.txt': '42', 'dup.txt': '2'}.items():
    r = subprocess.run(["python3", "stats.py", "/tests/cases/" + case], capture_output=True, text=True, timeout=10)
    if r.returncode != 0 or r.stdout.strip() != want:
        fail(f"{case}: want {want}, got {r.stdout.strip()!r} {r.stderr[-300:]!r}")
print("PASS")
