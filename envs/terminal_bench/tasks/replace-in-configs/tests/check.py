"""Checks for replace-in-configs; exit 0 = pass."""
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


expected = {'config/app.conf': 'name = app\nbackend = foo_v2\nfallback = foo_v2_legacy\n', 'config/db/db.conf': 'driver=foo_v2\n# foo_v2 is the default\n', 'config/db/deep/cache.conf': 'use foo_v2\n', 'config/README.md': 'Configs reference foo_v1.\n', 'config/legacy.txt': 'foo_v1\n', 'config/app.conf.bak': 'backend = foo_v1\n'}
for path, want in expected.items():
    try:
        if open(path).read() != want:
            fail(path)
    except OSError as e:
        fail(e)
print("PASS")
