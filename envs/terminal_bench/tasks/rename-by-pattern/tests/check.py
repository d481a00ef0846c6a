"""Checks for rename-by-pattern; exit 0 = pass."""
import os
import sys


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


expected = {'photo-0001.jpg': 'image 1\n', 'photo-0002.jpg': 'image 2\n', 'photo-0007.jpg': 'image 7\n', 'photo-0012.jpg': 'image 12\n', 'photo-0130.jpg': 'image 130\n', 'notes.txt': 'not a photo\n', 'IMG_draft.jpeg': 'draft\n'}
try:
    got = {f: open(os.path.join("photos", f)).read() for f in os.listdir("photos")}
except OSError as e:
    fail(e)
if got != expected:
    fail(sorted(got))
print("PASS")
