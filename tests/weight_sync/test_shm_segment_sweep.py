"""Shared-memory segments of a process that died without closing them (a killed trainer) are deleted by the
next segment made on the machine; a live owner's are not, however old."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from miles_agent.transports.shm import SharedSegment, sweep_stale_segments

MAKE_AND_HANG = """
from miles_agent.transports.shm import SharedSegment
seg = SharedSegment(1 << 20)
print(seg.path, flush=True)
import time
time.sleep(600)
"""


def test_a_killed_owners_segment_is_swept_and_a_live_ones_is_kept():
    child = subprocess.Popen([sys.executable, "-c", MAKE_AND_HANG], stdout=subprocess.PIPE, text=True)
    try:
        orphan = child.stdout.readline().strip()
        live = SharedSegment(1 << 20)
        old = time.time() - 3600
        for path in (orphan, live.path):
            os.utime(path, (old, old))  # both past the grace period for files not locked yet
        folder = os.path.dirname(orphan)
        assert sweep_stale_segments(folder) == 0 and os.path.exists(orphan)  # its owner still holds the lock
        child.send_signal(signal.SIGKILL)  # no finalizer runs: the file stays behind
        child.wait(30)
        assert os.path.exists(orphan)
        SharedSegment(1 << 20).close()  # making a segment sweeps the folder first
        assert not os.path.exists(orphan) and os.path.exists(live.path)
        live.close()
        assert not os.path.exists(live.path)
    finally:
        child.kill()
