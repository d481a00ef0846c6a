"""Checks for git-init-commit; exit 0 = pass."""
import subprocess
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def git(*args):
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", "project", *args], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


subjects = git("log", "--format=%s").splitlines()
if subjects != ["Initial commit"]:
    fail(subjects)
files = sorted(git("ls-files").split())
if files != ["README.md", "lib/util.py", "main.py"]:
    fail(files)
if git("status", "--porcelain").strip():
    fail("uncommitted changes remain")
print("PASS")
