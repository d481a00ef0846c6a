"""Checks for copy-file; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


expected = '[server]\nhost = 127.0.0.1\nport = 8080\n\n[log]\nlevel = info\n'
for path in ("data/config.ini", "backup/config.ini"):
    try:
        if open(path).read() != expected:
            fail(path + " differs from the original")
    except OSError as e:
        fail(e)
print("PASS")
