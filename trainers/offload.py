"""Give a trainer's device memory back while colocated engines generate, and take it back exactly.

What moves: every storage behind the modules' parameters and buffers, the parameters' gradients and
the optimizer's state tensors, each once (FSDP2's sharded parameters are views into one padded buffer;
tied weights share a storage). ``offload`` copies each storage's bytes into a host buffer (pinned on
CUDA) and resizes the storage to 0 bytes, which hands its memory back to the allocator;
``torch.cuda.empty_cache()`` then returns it to the device. ``reload`` grows each storage back and copies
the bytes in.

Why storages, not ``model.to("cpu")``: the tensor objects survive. The optimizer's state stays keyed by
the same parameters, FSDP2 keeps its views of its shards, nothing is re-wrapped, and the bytes that come
back are the bytes that left (so training after a round trip is bit-identical). On a CPU trainer the
same code runs host to host, and the release is still observable: the trainer's storages hold 0 bytes
while offloaded (`resident_bytes`), which is what the CPU tests check.

Host buffers are kept between round trips (pooled by size): pinned allocations are slow, and the host
must hold the whole trainer state while it is offloaded anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn


class DeviceOffload:
    """The offload / reload pair for one trainer: ``modules()`` and ``optimizer`` name what it holds."""

    def __init__(self, modules: Callable[[], Iterable[nn.Module | None]], optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self._modules, self.optimizer, self.device = modules, optimizer, torch.device(device)
        self._saved: list[tuple[torch.UntypedStorage, Tensor]] = []  # (released storage, its host copy)
        self._pool: dict[int, list[Tensor]] = {}  # idle host buffers by size
        self.offloaded = False

    # -- what the trainer holds ------------------------------------------------------------------------
    def _tensors(self) -> Iterator[Tensor]:
        for module in self._modules():
            if module is None:
                continue
            for p in module.parameters():
                yield p
                if p.grad is not None:
                    yield p.grad
            yield from module.buffers()
        for group in self.optimizer.param_groups:  # parameters outside the modules (fp32 main copies)
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))

    def _storages(self) -> list[torch.UntypedStorage]:
        """Each storage on the trainer's device once (optimizer step counters on the host stay)."""
        from torch.distributed.tensor import DTensor

        seen: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad():
            for t in self._tensors():
                local = t.to_local() if isinstance(t, DTensor) else t
                storage = local.untyped_storage()
                if storage.device.type != self.device.type or storage.nbytes() == 0 or not storage.resizable():
                    continue
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def resident_bytes(self) -> int:
        """Bytes the trainer's tensors hold on its device now (0 while offloaded)."""
        return sum(s.nbytes() for s in self._storages())

    # -- the round trip ------------------------------------------------------------------------------
    def offload(self) -> dict[str, float]:
        """Everything to host, device storages freed. A no-op when already offloaded."""
        if self.offloaded:
            return {"offload_bytes": 0.0, "offload_s": 0.0}
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        saved = []
        for storage in self._storages():
            host = self._host_buffer(storage.nbytes(), pin=cuda)
            host.untyped_storage().copy_(storage, non_blocking=cuda)
            saved.append((storage, host))
        if cuda:
            torch.cuda.synchronize(self.device)  # the copies must land before the memory goes
        for storage, _ in saved:
            storage.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        self._saved, self.offloaded = saved, True
        return {"offload_bytes": float(sum(h.numel() for _, h in saved)), "offload_s": time.perf_counter() - t0}

    def reload(self) -> dict[str, float]:
        """Every storage back on the device with the bytes it had. A no-op when resident."""
        if not self.offloaded:
            return {"reload_bytes": 0.0, "reload_s": 0.0}
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        moved = 0
        for storage, host in self._saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=cuda)
            moved += host.numel()
        if cuda:
            torch.cuda.synchronize(self.device)  # host buffers are reused: the copies must finish first
        for _, host in self._saved:
            self._pool.setdefault(host.numel(), []).append(host)
        self._saved, self.offloaded = [], False
        return {"reload_bytes": float(moved), "reload_s": time.perf_counter() - t0}

    def _host_buffer(self, nbytes: int, pin: bool) -> Tensor:
        free = self._pool.get(nbytes)
        if free:
            return free.pop()
        if pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
            except RuntimeError:  # the host cannot lock this much: pageable memory, slower copies
                pass
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

