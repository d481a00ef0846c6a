"""Checks for backup-script; exit 0 = pass."""
import os
import subprocess
import sys
import tarfile
import tempfile


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


if not os.access("backup.sh", os.X_OK):
    fail("backup.sh is missing or not executable")
script = os.path.abspath("backup.sh")
with tempfile.TemporaryDirectory(dir=".") as tmp:
    os.makedirs(os.path.join(tmp, "proj", "sub"))
    for rel, text in (("proj/a.txt", "alpha\n"), ("proj/sub/b.txt", "beta\n")):
        with open(os.path.join(tmp, rel), "w") as f:
            f.write(text)
    r = subprocess.run([script], cwd=tmp, capture_output=True, text=True, timeout=10)
    if r.returncode != 1 or not r.stderr.strip() or r.stdout.strip() or len(os.listdir(tmp)) != 1:
        fail(f"no-argument call: exit {r.returncode}, stderr {r.stderr!r}, stdout {r.stdout!r}")
    r = subprocess.run([script, "proj"], cwd=tmp, capture_output=True, text=True, timeout=10)
    archive = os.path.join(tmp, "proj.tar.gz")
    if r.returncode != 0 or not os.path.isfile(archive):
        fail(f"backup.sh proj: exit {r.returncode}, {r.stderr!r}")
    with tarfile.open(archive, "r:gz") as t:
        names = {m.name.removeprefix("./").rstrip("/") for m in t.getmembers() if m.isfile()}
        if names != {"proj/a.txt", "proj/sub/b.txt"}:
            fail(sorted(names))
        if t.extractfile("proj/sub/b.txt").read() != b"beta\n":
            fail("content differs")
print("PASS")
