"""The engine side of a weight sync, shaped like SGLang's server endpoints so one set of transports
drives every engine: an in-process `EmbeddedEngine` (through `InProcessReceiver`), a `EmbeddedEngine` in another
process (`miles_agent.engines.embedded.process.EngineProcess`), or an SGLang server (its HTTP client).

Method and argument names follow SGLang's ``io_struct`` request types:
``update_weights_from_tensor`` (UpdateWeightsFromTensorReqInput), ``init_weights_update_group``
(InitWeightsUpdateGroupReqInput), ``update_weights_from_distributed``
(UpdateWeightsFromDistributedReqInput), ``update_weights_from_disk`` (UpdateWeightFromDiskReqInput),
``destroy_weights_update_group``, ``check_weights`` (``/weights_checker``, action ``checksum``),
``pause_generation`` / ``continue_generation``. A failed request raises (an HTTP client turns SGLang's
``success: false`` into `WeightSyncError`).
"""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles_agent.engine import PauseMode, RolloutEngine
from miles_agent.transports.core import (
    TensorMeta,
    WeightSyncError,
    bucket_metadata,
    module_checksums,
    unpack,
)
from miles_agent.transports.groups import DEFAULT_GROUP

if TYPE_CHECKING:  # pragma: no cover
    import torch

@runtime_checkable
class WeightReceiver(Protocol):
    """What a transport calls on an engine (SGLang's weight-update endpoints, as async methods)."""

    async def pause_generation(self, mode: str = "in_place") -> None: ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_tensor(self, serialized_named_tensors: list[bytes], load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None) -> None: ...

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None: ...

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> None: ...

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None: ...

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None) -> None: ...

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]: ...


class InProcessReceiver:
    """SGLang's weight-update API over a `RolloutEngine` whose ``model`` is a torch module (EmbeddedEngine).

    Serialized tensors are unpickled with torch's multiprocessing reductions (shared-memory storages on
    CPU, CUDA IPC handles on GPU), so only a trusted local trainer may call ``update_weights_from_tensor``.
    """

    receives_streams = True  # takes a whole distributed push in one call (`receive_weights_stream`)

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._groups: dict[str, Any] = {}
        self._shared: Any = None  # the last shared buffer, kept so its mapping is reused by the next bucket
        self._recv_buffer: Any = None  # flat receive buffer reused across buckets (no page faults per bucket)
        self._paused = False
        # One receive at a time per group, in announcement order: the sender announces bucket n+1 while
        # bucket n is still being received, and two threads in collectives on one gloo group match the wrong
        # messages (gloo aborts the process: "Received data size doesn't match expected size").
        self._next_bucket: dict[str, int] = {}  # per group: the bucket whose turn it is
        self._arrived: dict[str, int] = {}  # per group: calls that came without a number (numbered on arrival)
        self._turn = asyncio.Condition()
        # Per group, one thread runs the receives, in the order they were handed to it: a bucket takes its turn
        # to hand its receive over, so the next bucket's broadcast starts the moment the last one ends, with no
        # event-loop hop between them (under Ray, that hop cost ~2 ms a bucket while the sender waited).
        self._lanes: dict[str, Any] = {}
        self._in_flight = 0  # bucket calls not yet loaded (see `settled`)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def device(self) -> torch.device:
        return next(iter(self.engine.model.parameters())).device

    async def pause_generation(self, mode: str = "in_place") -> None:
        await self.engine.pause(PauseMode(mode))
        self._paused = True

    async def continue_generation(self) -> None:
        self._paused = False
        await self.engine.resume()

    async def update_weights_from_tensor(self, serialized_named_tensors: list[bytes], load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None) -> None:
        import base64

        import torch.multiprocessing  # noqa: F401 - registers the reductions that rebuild shared tensors

        if not serialized_named_tensors:
            raise WeightSyncError("update_weights_from_tensor: serialized_named_tensors is empty")
        data = serialized_named_tensors[0]  # one entry per tensor-parallel rank; this engine is rank 0
        payload = pickle.loads(base64.b64decode(data) if isinstance(data, str) else data)
        if load_format == "flattened_bucket":
            flat = payload["flattened_tensor"]
            self._shared = flat
            items = unpack(flat, [_meta(m) for m in payload["metadata"]])
        elif load_format is None:
            items = list(payload)
        else:
            raise WeightSyncError(f"update_weights_from_tensor: unknown load_format {load_format!r} "
                                  "(expected None or 'flattened_bucket')")
        await self._load(items, weight_version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None:
        from miles_agent.transports.groups import init_custom_process_group

        if group_name in self._groups:
            raise WeightSyncError(f"weight update group {group_name!r} already exists on this engine; "
                                  "destroy it first (destroy_weights_update_group)")
        self._groups[group_name] = await asyncio.to_thread(
            init_custom_process_group, backend, master_address, master_port, rank_offset, world_size, group_name)
        self._next_bucket[group_name] = self._arrived[group_name] = 0

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None, bucket: int | None = None) -> None:
        """``bucket``: the announcement's number since the group formed, where calls may start out of order
        (a Ray actor); without it, calls are numbered as they arrive."""
        self._in_flight += 1
        try:
            await self._update_from_distributed(names, dtypes, shapes, group_name, weight_version, load_format,
                                                bucket)
        finally:
            async with self._turn:
                self._in_flight -= 1
                self._turn.notify_all()

    async def receive_weights_stream(self, group_name: str = DEFAULT_GROUP, weight_version: str | None = None
                                     ) -> None:
        """A whole distributed push in one call (transports/stream.py): per bucket a header, then its
        tensors, until the end marker. Each tensor lands where `update_weights_from_distributed` puts it
        (straight in its parameter while paused); a bucket that needs a load is loaded while the next one
        is received. A failed load does not stop the receiving, or the sender would wait in its broadcast:
        the rest of the push is received but not loaded, and the first error is raised at the end."""
        import torch.distributed as dist

        from miles_agent.transports.stream import receive_header

        if group_name not in self._groups:
            raise WeightSyncError(f"no weight update group {group_name!r} on this engine; call "
                                  "init_weights_update_group first")
        group, device = self._groups[group_name], self.device
        loop = asyncio.get_running_loop()

        def broadcast(t: torch.Tensor) -> None:
            dist.broadcast(t, 0, group)

        def receive() -> BaseException | None:  # on the group's receive thread
            loading, failed = None, None  # the last bucket's load (a future on the loop), the first error
            targets = self._targets()  # the model's modules do not change during a push
            while (metas := receive_header(broadcast, device)) is not None:
                destinations, items = self._destinations(metas, device, targets)
                for _, t in destinations:
                    broadcast(t)
                if loading is not None:
                    failed = failed or loading.exception()
                    loading = None
                if items and failed is None:
                    loading = asyncio.run_coroutine_threadsafe(self._load(items, weight_version), loop)
            return failed or (loading.exception() if loading is not None else None)

        failed = await loop.run_in_executor(self._lane(group_name), receive)
        if failed is not None:
            raise failed
        await self._load([], weight_version)  # the version, and a new weights epoch for what went straight in

    async def settled(self) -> None:
        """Returns once every bucket call that has arrived has loaded (or failed): what a resume carried by a
        push's last bucket waits for, since an earlier bucket's load may still be queued behind a step."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._in_flight == 0)

    async def _update_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                       group_name: str, weight_version: str | None, load_format: str | None,
                                       bucket: int | None) -> None:
        import torch.distributed as dist

        if group_name not in self._groups:
            raise WeightSyncError(f"no weight update group {group_name!r} on this engine; call "
                                  "init_weights_update_group first")
        if load_format not in ("flattened_bucket", None):
            raise WeightSyncError(f"update_weights_from_distributed: unknown load_format {load_format!r}")
        group = self._groups[group_name]
        if bucket is None:
            bucket = self._arrived[group_name]
            self._arrived[group_name] += 1
        await self._wait_turn(group_name, bucket)
        loop, lane = asyncio.get_running_loop(), self._lane(group_name)
        try:
            if load_format == "flattened_bucket":  # the flat buffer is reused: loaded before the next receive
                metas = bucket_metadata(names, dtypes, shapes)
                flat = self._flat_buffer(metas[-1].end_idx if metas else 0)
                await loop.run_in_executor(lane, dist.broadcast, flat, 0, group)
                await self._load(unpack(flat, metas), weight_version)
                return
            # One broadcast per tensor, in the announced order, into this call's own destinations.
            destinations, items = self._destinations(bucket_metadata(names, dtypes, shapes, flat=False), self.device)

            def receive() -> None:
                for _, t in destinations:
                    dist.broadcast(t, 0, group)
            received = loop.run_in_executor(lane, receive)  # queued behind the last bucket's receive
        finally:
            await self._end_turn(group_name, bucket)  # the next bucket queues its receive; it overlaps this load
        await received
        await self._load(items, weight_version)

    def _lane(self, group_name: str) -> Any:
        """The group's receive thread (see __init__)."""
        from concurrent.futures import ThreadPoolExecutor

        if group_name not in self._lanes:
            self._lanes[group_name] = ThreadPoolExecutor(1, thread_name_prefix=f"weights-{group_name}")
        return self._lanes[group_name]

    async def _wait_turn(self, group_name: str, bucket: int, timeout_s: float = 600.0) -> None:
        async with self._turn:
            try:
                await asyncio.wait_for(self._turn.wait_for(
                    lambda: self._next_bucket.get(group_name, bucket) == bucket), timeout_s)
            except TimeoutError:
                raise WeightSyncError(f"bucket {bucket} of weight-update group {group_name!r} waited {timeout_s:.0f} s "
                                      f"for bucket {self._next_bucket.get(group_name)}, which never came; the "
                                      "sender's broadcast broke off (its error says why)") from None
            if group_name not in self._next_bucket:
                raise WeightSyncError(f"weight-update group {group_name!r} was destroyed while bucket {bucket} "
                                      "waited for its turn")

    async def _end_turn(self, group_name: str, bucket: int) -> None:
        async with self._turn:
            if group_name in self._next_bucket:
                self._next_bucket[group_name] = bucket + 1
            self._turn.notify_all()

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        from miles_agent.transports.groups import destroy_group

        async with self._turn:  # buckets still waiting for their turn in this group fail now
            self._next_bucket.pop(group_name, None)
            self._arrived.pop(group_name, None)
            self._turn.notify_all()
        group = self._groups.pop(group_name, None)
        lane = self._lanes.pop(group_name, None)
        if lane is not None:
            lane.shutdown(wait=False)  # receives already queued still run (and fail on the destroyed group)
        if group is None:
            raise WeightSyncError(f"no weight update group {group_name!r} to destroy")
        destroy_group(group)

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None) -> None:
        import torch

        from miles_agent.transports.safetensors_io import read_header, read_into

        for path in safetensors_files(Path(model_path)):  # shard by shard: extra memory is at most a shard
            start, metas = read_header(path)
            destinations, items = self._destinations(metas, torch.device("cpu"))
            await asyncio.to_thread(read_into, path, start, metas, [t for _, t in destinations])
            await self._load(items, weight_version)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        if action != "checksum":
            raise WeightSyncError(f"check_weights: only action='checksum' is supported, got {action!r}")
        return {"checksums": await asyncio.to_thread(module_checksums, self.engine.model)}

    def _destinations(self, metas: list[TensorMeta], device: torch.device, targets: dict[str, Any] | None = None
                      ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """Where each announced tensor lands: straight in the engine's own parameter when that is safe (the
        engine was paused through this receiver or only holds a model; same dtype, shape and device;
        contiguous), which saves a copy, else in a new buffer that is then loaded through the engine.
        Returns (all destinations in order, the buffers to load). ``targets``: `_targets()`, when the
        caller keeps it across buckets."""
        import torch

        targets = self._targets() if targets is None else targets
        quiet = self._paused or isinstance(self.engine, ModelHolder)  # nothing reads the weights meanwhile
        destinations, to_load = [], []
        for m in metas:
            dtype = getattr(torch, m.dtype)
            t = targets.get(m.name)
            if (quiet and t is not None and t.dtype == dtype and tuple(t.shape) == m.shape
                    and t.is_contiguous() and t.device == device):
                destinations.append((m.name, t.detach()))
            else:
                buf = torch.empty(m.shape, dtype=dtype, device=device)
                destinations.append((m.name, buf))
                to_load.append((m.name, buf))
        return destinations, to_load

    def _targets(self) -> dict[str, Any]:
        """The engine's parameters and buffers by name."""
        model = self.engine.model
        targets = dict(model.named_parameters(remove_duplicate=False))
        targets.update(model.named_buffers(remove_duplicate=False))
        return targets

    def _flat_buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        if self._recv_buffer is None or self._recv_buffer.numel() < nbytes:
            self._recv_buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._recv_buffer[:nbytes]

    async def _load(self, items: Iterable[tuple[str, torch.Tensor]], weight_version: str | None) -> None:
        version = self.engine.weight_version if weight_version is None else int(weight_version)
        await self.engine.update_weights(list(items), version)


class ModelHolder:
    """The weight side of an engine without the serving side: a torch module and a version (no KV cache,
    no generate). What a receiver needs when only the weights matter, e.g. in benchmarks."""

    def __init__(self, model: torch.nn.Module, weight_version: int = 0) -> None:
        self.model = model
        self.weight_version = weight_version

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        """Nothing is generating, so there is nothing to pause."""

    async def resume(self) -> None:
        """See `pause`."""

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        load_named(self.model, list(named_tensors))  # inline: nothing else runs here, a thread hop costs a wake-up
        self.weight_version = int(version)


def load_named(model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into a module's parameters/buffers by name; every name and shape is checked first."""
    import torch

    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    for name, t in items:
        if name not in targets:
            raise WeightSyncError(f"the model has no parameter named {name!r}")
        if tuple(targets[name].shape) != tuple(t.shape):
            raise WeightSyncError(f"{name!r} has shape {tuple(targets[name].shape)} in the model but "
                                  f"{tuple(t.shape)} was sent")
    with torch.no_grad():
        for name, t in items:
            targets[name].copy_(t)


def safetensors_files(folder: Path) -> list[Path]:
    """The shards of an HF-style weights folder: those its index names, else every *.safetensors."""
    if not folder.is_dir():
        raise WeightSyncError(f"update_weights_from_disk: {folder} is not a folder")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if missing or not files:
        raise WeightSyncError(f"update_weights_from_disk: {folder} lacks safetensors files "
                              f"({', '.join(missing) or 'none found'})")
    return files


def _meta(m: Any) -> TensorMeta:
    """Flat-bucket metadata from our TensorMeta, SGLang's FlattenedTensorMetadata, or a plain dict."""
    get = m.get if isinstance(m, dict) else lambda k: getattr(m, k)
    dtype = get("dtype")
    dtype = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return TensorMeta(get("name"), tuple(get("shape")), dtype, int(get("start_idx")), int(get("end_idx")),
                      int(get("numel")))
