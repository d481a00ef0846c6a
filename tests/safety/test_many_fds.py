"""The soak (256 sandboxes at once) took the process past 1024 open fds; the local sandbox's start-up read
used select(), which refuses any fd >= FD_SETSIZE (ValueError), so every start beyond that failed."""

from __future__ import annotations

import fcntl
import os
import resource

import pytest


def test_the_sandbox_ready_line_is_read_from_a_descriptor_above_1024():
    from miles_agent.sandboxes._local_storage import _read_available, _read_line

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200:
        pytest.skip("this host's fd limit is below 1200")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    r, w = os.pipe()
    high = fcntl.fcntl(r, fcntl.F_DUPFD, 1100)
    try:
        os.write(w, b"ready 42\n")
        assert _read_line(high, 2.0) == b"ready 42"
        assert _read_line(high, 0.1) == b""  # nothing more: times out, no error
        os.write(w, b"tail")
        assert _read_available(high) == b"tail"
    finally:
        for fd in (r, w, high):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
