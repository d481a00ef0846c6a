"""A rollout engine in a separate OS process, driven through the same weight-update API as an SGLang server.

`EngineProcess` spawns a child that builds its model (``model_fn``, a picklable callable), wraps it in a
`EmbeddedEngine` and a `InProcessReceiver`, and serves requests -- every `WeightReceiver` method plus
``generate`` -- over a pipe, one at a time. It is the embedded stand-in for a remote engine: the shm,
distributed and disk transports cross a real process boundary with it, and a Ray actor can host the
same receiver.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import time
from collections import deque
from typing import Any

from miles_agent.engine import Completion, SamplingParams
from miles_agent.transports.core import WeightSyncError
from miles_agent.transports.groups import DEFAULT_GROUP


def tiny_model(arch: str = "tiny-qwen3", seed: int = 0, dtype: str = "float32") -> Any:
    """A picklable model_fn: the built-in tiny architecture (its tokenizer is not needed to serve ids)."""
    from miles_agent.models.builder import build_tiny

    return build_tiny(arch, seed=seed, dtype=dtype)[0]


def tiny_model_fn(arch: str = "tiny-qwen3", seed: int = 0, dtype: str = "float32") -> functools.partial:
    return functools.partial(tiny_model, arch, seed, dtype)


def _serve(conn: Any, model_fn: Any, device: str, max_batch_size: int, num_threads: int | None,
           serve: bool) -> None:
    """Child main: build the engine, then answer (method, kwargs) requests until told to stop."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.transports.receiver import InProcessReceiver, ModelHolder

    try:
        model = model_fn()
        engine = (EmbeddedEngine(model, None, max_batch_size=max_batch_size, device=device) if serve
                  else ModelHolder(model.to(device)))
        receiver = InProcessReceiver(engine)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"building the engine failed: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))

    async def handle(method: str, kwargs: dict[str, Any]) -> Any:
        if method == "generate":
            if not serve:
                raise ValueError("this engine process holds only a model (serve=False); it cannot generate")
            return await engine.generate(kwargs["input_ids"], kwargs.get("sampling"))
        if method == "weight_version":
            return engine.weight_version
        return await getattr(receiver, method)(**kwargs)

    async def loop() -> None:
        inbox: asyncio.Queue = asyncio.Queue()

        def readable() -> None:  # on the loop's thread: no thread hand-off per request
            try:
                inbox.put_nowait(conn.recv())
            except EOFError:  # the parent is gone
                asyncio.get_running_loop().remove_reader(conn.fileno())
                inbox.put_nowait(None)

        asyncio.get_running_loop().add_reader(conn.fileno(), readable)
        while (msg := await inbox.get()) is not None:
            method, kwargs = msg
            try:
                reply = ("ok", await handle(method, kwargs))
            except Exception as e:  # noqa: BLE001 - every failure goes back to the caller by name
                reply = ("error", f"{type(e).__name__}: {e}")
            conn.send(reply)
        if serve:
            await engine.shutdown()

    asyncio.run(loop())


class EngineProcess:
    """Client of one engine process; its async methods are the `WeightReceiver` API plus ``generate``.

Requests go out as soon as they are made and the child answers them in order, so a caller may queue
the next request (the next bucket's announcement) before the last one is answered.
"""

    receives_streams = True  # the child's InProcessReceiver takes a whole distributed push in one request

    def __init__(self, model_fn: Any, *, serve: bool = True, device: str = "cpu", max_batch_size: int = 8,
                 start_method: str = "spawn", num_threads: int | None = None, start_timeout_s: float = 120.0,
                 call_timeout_s: float = 600.0) -> None:
        self.model_fn = model_fn
        self.serve = serve  # False: hold only the model (a ModelHolder): weights move, nothing generates
        self.num_threads = num_threads  # torch intra-op threads in the child; None = torch's default
        self.start_method = start_method  # spawn is safe with CUDA and threads; fork starts in a fraction
        self.device = device
        self.max_batch_size = max_batch_size
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.pid: int | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._waiting: deque[asyncio.Future] = deque()  # requests in flight; the child answers in order
        self._reader_loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> EngineProcess:
        """Start the child and wait until its engine is built."""
        ctx = mp.get_context(self.start_method)
        self._conn, child = ctx.Pipe()
        args = (child, self.model_fn, self.device, self.max_batch_size, self.num_threads, self.serve)
        self._proc = ctx.Process(target=_serve, args=args, daemon=True, name="miles-engine")
        self._proc.start()
        child.close()
        kind, value = self._recv(self.start_timeout_s, "starting")
        if kind != "ready":
            self.close()
            raise WeightSyncError(f"engine process failed to start: {value}")
        self.pid = value
        return self

    def close(self) -> None:
        """Stop the child (politely, then by force) and release the pipe."""
        if self._proc is None:
            return
        try:
            if self._proc.is_alive():
                self._conn.send(None)
                self._proc.join(10)
        except (OSError, BrokenPipeError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
        self._proc = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the requests --------------------------------------------------------------------------------
    async def call(self, method: str, **kwargs: Any) -> Any:
        if self._proc is None:
            raise WeightSyncError(f"{method}: the engine process is not running (call start() first)")
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._waiting.append(reply)
        self._conn.send((method, kwargs))  # sent now: a caller may queue the next request before this answer
        if self._reader_loop is not loop:
            loop.add_reader(self._conn.fileno(), self._on_readable)
            self._reader_loop = loop
        try:
            kind, value = await self._reply(reply, self.call_timeout_s, method)
        finally:
            if not self._waiting and self._reader_loop is loop:
                loop.remove_reader(self._conn.fileno())
                self._reader_loop = None
        if kind == "error":
            raise WeightSyncError(f"engine process (pid {self.pid}) {method}: {value}")
        return value

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None) -> Completion:
        return await self.call("generate", input_ids=list(input_ids), sampling=sampling)

    async def weight_version(self) -> int:
        return await self.call("weight_version")

    async def pause_generation(self, mode: str = "in_place") -> None:
        if self.serve:  # a model-only process generates nothing: no round trip to pause it
            await self.call("pause_generation", mode=mode)

    async def continue_generation(self) -> None:
        if self.serve:
            await self.call("continue_generation")

    async def update_weights_from_tensor(self, serialized_named_tensors: list[bytes], load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None) -> None:
        await self.call("update_weights_from_tensor", serialized_named_tensors=serialized_named_tensors,
                        load_format=load_format, flush_cache=flush_cache, weight_version=weight_version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None:
        await self.call("init_weights_update_group", master_address=master_address, master_port=master_port,
                        rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> None:
        await self.call("update_weights_from_distributed", names=names, dtypes=dtypes, shapes=shapes,
                        group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
                        load_format=load_format)

    async def receive_weights_stream(self, group_name: str = DEFAULT_GROUP, weight_version: str | None = None
                                     ) -> None:
        await self.call("receive_weights_stream", group_name=group_name, weight_version=weight_version)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self.call("destroy_weights_update_group", group_name=group_name)

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None) -> None:
        await self.call("update_weights_from_disk", model_path=model_path, load_format=load_format,
                        weight_version=weight_version)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        return await self.call("check_weights", action=action)

    def _on_readable(self) -> None:
        """Hand each answer that has arrived to the oldest request still waiting (on the loop's thread)."""
        try:
            while self._waiting and self._conn.poll():
                msg = self._conn.recv()
                reply = self._waiting.popleft()
                if not reply.done():  # a cancelled caller's answer is dropped, the order stays right
                    reply.set_result(msg)
        except (EOFError, OSError):
            while self._waiting:
                reply = self._waiting.popleft()
                if not reply.done():
                    reply.set_exception(WeightSyncError(f"engine process (pid {self.pid}) closed its pipe"))

    async def _reply(self, reply: asyncio.Future, timeout_s: float, what: str) -> tuple[str, Any]:
        """Wait for this request's answer, checking twice a second that the child is alive."""
        deadline = time.monotonic() + timeout_s
        while not reply.done():
            await asyncio.wait([reply], timeout=0.5)
            if reply.done():
                break
            if not self._proc.is_alive():
                raise WeightSyncError(f"engine process (pid {self._proc.pid}) exited with code "
                                      f"{self._proc.exitcode} during {what}")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"engine process gave no answer to {what} within {timeout_s:.0f} s")
        return reply.result()

    def _recv(self, timeout_s: float, what: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise WeightSyncError(f"engine process (pid {self._proc.pid}) exited with code "
                                      f"{self._proc.exitcode} during {what}")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"engine process gave no answer to {what} within {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError as e:
            raise WeightSyncError(f"engine process closed its pipe during {what}") from e
