"""`copy_many_`, the host copy every weight load of the embedded engine and every shared-memory push goes
through: every pair ends up equal whatever its shape, dtype or layout, and a forked child (engine processes
are forked) still copies after its parent's copy threads have started."""

from __future__ import annotations

import multiprocessing

import torch

from miles_agent.transports import core
from miles_agent.transports.core import copy_many_


def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3 << 20, generator=g)  # 12 MiB: cut into chunks across threads
    odd = torch.randn((1 << 20) + 7, generator=g)  # a last chunk shorter than the others
    return [(torch.empty_like(big), big), (torch.empty_like(odd), odd),
            (torch.empty(5), torch.randn(5, generator=g)),  # small: stays on the caller
            (torch.empty(64, 32), torch.randn(32, 64, generator=g).t()),  # not contiguous: plain copy
            (torch.empty(8, dtype=torch.float32), torch.randn(8, generator=g).to(torch.bfloat16))]  # converts


def test_every_pair_is_copied_exactly(monkeypatch):
    for threads in (1, 2, 4):
        monkeypatch.setattr(core, "copy_threads", lambda threads=threads: threads)
        work = pairs()
        copy_many_(work)
        for dst, src in work:
            assert torch.equal(dst, src.to(dst.dtype)), (threads, tuple(dst.shape))


def _copy_in_child(queue) -> None:
    work = pairs()
    copy_many_(work)
    queue.put(all(torch.equal(d, s.to(d.dtype)) for d, s in work))


def test_a_forked_child_copies_after_its_parent_started_the_copy_threads(monkeypatch):
    monkeypatch.setattr(core, "copy_threads", lambda: 2)
    copy_many_(pairs())  # the parent's pool exists now; a forked child has it without its threads
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and queue.get(timeout=5) is True
