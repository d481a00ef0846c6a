"""SGLangEngine: the `RolloutEngine` contract and the `WeightReceiver` protocol over one SGLang server's
HTTP API (routes and status codes from sglang/srt/entrypoints/http_server.py).

Generation goes to ``generate_urls`` (the router, when there is one; else every server, round-robin,
skipping a server that just failed until it answers a health check again) or to the server itself;
control and weight requests always go to the server itself. Every weight transport drives a server through this
client: shm / CUDA IPC -> ``/update_weights_from_tensor``, distributed -> ``/init_weights_update_group``
+ ``/update_weights_from_distributed``, disk -> ``/update_weights_from_disk``.

Failure rules: a 400 from ``/generate`` is bad input and raises ValueError with the server's message
(as EmbeddedEngine does). A server that dies, times out or answers 5xx mid-request is infrastructure: the
request comes back as FinishReason.ABORT with ``meta["error"]`` (the harness marks the trajectory
ABORTED, so the episode is retried and counted, never scored 0) and ``stats["engine_errors"]`` counts it.
A weight request that fails (``success: false``, a non-200, a dead server) raises `WeightSyncError`.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from miles_agent.engine import Completion, FinishReason, PauseMode, SamplingParams
from miles_agent.engines.sglang.wire import generate_payload, parse_generate_response
from miles_agent.errors import require
from miles_agent.transports.core import WeightSyncError
from miles_agent.transports.groups import DEFAULT_GROUP

if TYPE_CHECKING:  # pragma: no cover
    import aiohttp
    import torch

log = logging.getLogger(__name__)


class SGLangEngine:
    """Client of one SGLang server (see module docstring). ``routed_top_k`` / ``routed_layers`` shape the
    routed-experts payload (it carries no shape); ``process`` is an `SGLangServer` this engine owns and
    stops on shutdown (None when attached to a server someone else runs)."""

    def __init__(self, url: str, *, generate_urls: list[str] | None = None, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 600.0, routed_top_k: int | None = None,
                 routed_layers: int | None = None, process: Any = None) -> None:
        self.url = url.rstrip("/")
        self.generate_urls = [u.rstrip("/") for u in (generate_urls or [url])]
        self._turn = itertools.count()
        self._down: set[str] = set()  # generate targets that failed; skipped until a health check passes
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.routed_top_k, self.routed_layers = routed_top_k, routed_layers
        self.process = process
        self.router_url: str | None = None  # set once registered with a router; shutdown deregisters
        self.stats: dict[str, int] = {"requests": 0, "engine_errors": 0, "aborted": 0}
        self._version = 0
        self._loras: dict[str, str] = {}  # adapters this client loaded (name -> folder)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r})"

    # -- RolloutEngine -------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(self, input_ids: list[int], sampling: SamplingParams | None = None, *,
                       return_routed_experts: bool = False, images: Iterable[Any] = ()) -> Completion:
        """One ``/generate``; ``images`` (a vision-language policy's `ImageInput`s) travel as ``image_data``."""
        aiohttp = _aiohttp()
        sampling = sampling or SamplingParams()
        ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("input_ids is empty; the engine needs at least one prompt token")
        payload = generate_payload(ids, sampling, return_routed_experts=return_routed_experts, images=list(images))
        self.stats["requests"] += 1
        target = self._pick()
        url = f"{target}/generate"
        try:
            async with self._http().post(url, json=payload,
                                         timeout=aiohttp.ClientTimeout(total=self.request_timeout_s)) as r:
                status, body = r.status, _json_or_text(await r.text())
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            self._down.add(target)
            return self._engine_error(f"SGLang server {url} failed mid-request ({type(e).__name__}: {e}); "
                                      "the request is aborted so the episode is retried", len(ids))
        if status == 400:  # the request itself is wrong: fix the caller, retrying cannot help
            raise ValueError(f"SGLang {url} rejected the request: {_error_message(body)}")
        if status != 200:
            self._down.add(target)
            return self._engine_error(f"SGLang server {url} answered HTTP {status}: {_error_message(body)}",
                                      len(ids))
        completion = parse_generate_response(body, prompt_len=len(ids), want_routed=return_routed_experts,
                                             routed_top_k=self.routed_top_k, routed_layers=self.routed_layers,
                                             current_version=self._version)
        if completion.finish_reason is FinishReason.ABORT:
            self.stats["aborted"] += 1
        return completion

    async def pause(self, mode: PauseMode = PauseMode.IN_PLACE) -> None:
        await self.pause_generation(str(PauseMode(mode)))

    async def resume(self) -> None:
        await self.continue_generation()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """The contract's in-process call, sent as ``/update_weights_from_tensor`` (tensors travel as
        shared-memory / CUDA IPC handles, so the server must be on this host)."""
        from miles_agent.transports.shm import serialize

        payload = serialize([(n, t.detach()) for n, t in named_tensors])
        await self.update_weights_from_tensor([payload], weight_version=str(version))

    async def health(self) -> bool:
        """``/health_generate``: 200 once the server generated a token (503 while starting or broken)."""
        if self.process is not None and not self.process.alive():
            return False
        for target in list(self._down):  # a generate target that recovered takes requests again
            if await self._healthy(target):
                self._down.discard(target)
        return await self._healthy(self.url)

    async def _healthy(self, base: str) -> bool:
        aiohttp = _aiohttp()
        try:
            async with self._http().get(f"{base}/health_generate",
                                        timeout=aiohttp.ClientTimeout(total=self.control_timeout_s)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            return False

    async def shutdown(self) -> None:
        """Leave the router, close the HTTP session, and stop the server when this engine launched it."""
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._session_loop = None
        if self.router_url:
            from miles_agent.engines.sglang.router import RouterError, remove_worker

            try:
                await asyncio.to_thread(remove_worker, self.router_url, self.url)
            except RouterError as e:  # the router may already be gone; the server still has to stop
                log.warning("%s", e)
            self.router_url = None
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)

    # -- WeightReceiver: SGLang's weight endpoints ---------------------------------------------------
    async def pause_generation(self, mode: str = "in_place") -> None:
        await self._post("/pause_generation", {"mode": str(PauseMode(mode))})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def update_weights_from_tensor(self, serialized_named_tensors: list[bytes], load_format: str | None = None,
                                         flush_cache: bool = True, weight_version: str | None = None) -> None:
        # io_struct: ``serialized_named_tensors: Annotated[List[bytes], Base64Bytes()]`` -> base64 strings in JSON
        encoded = [d if isinstance(d, str) else base64.b64encode(d).decode("ascii") for d in serialized_named_tensors]
        await self._weights("/update_weights_from_tensor", dict(
            serialized_named_tensors=encoded, load_format=load_format, flush_cache=flush_cache,
            weight_version=weight_version), weight_version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = DEFAULT_GROUP,
                                        backend: str = "nccl") -> None:
        await self._weights("/init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend), None)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                              weight_version: str | None = None,
                                              load_format: str | None = None) -> None:
        # The broadcasts must be received in announce order. Two pipelined POSTs travel on two connections
        # and may reach the server in either order, so each announce waits for the previous one's answer.
        async with self._announce_lock():
            await self._weights("/update_weights_from_distributed", dict(
                names=names, dtypes=dtypes, shapes=[list(s) for s in shapes], group_name=group_name,
                flush_cache=flush_cache, weight_version=weight_version, load_format=load_format), weight_version)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> None:
        await self._weights("/destroy_weights_update_group", {"group_name": group_name}, None)

    async def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                       weight_version: str | None = None) -> None:
        await self._weights("/update_weights_from_disk", dict(
            model_path=model_path, load_format=load_format, weight_version=weight_version), weight_version)

    async def check_weights(self, action: str = "checksum") -> dict[str, Any]:
        body = await self._weights("/weights_checker", {"action": action}, None)
        if not isinstance(body, dict) or "checksums" not in body:
            raise WeightSyncError(f"{self.url}/weights_checker reports no per-tensor checksums (SGLang's checker "
                                  "hashes whole engines), so sync.check cannot compare tensors; set "
                                  "sync.check=false with rollout.engine=sglang")
        return body

    # -- the rest of the admin API -------------------------------------------------------------------
    async def flush_cache(self) -> None:
        """``/flush_cache``: 400 (refused) while requests are running or waiting."""
        await self._post("/flush_cache", None)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the server's GPU memory (weights and/or KV cache) so a colocated trainer can use it."""
        await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", {"tags": tags})

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        body = await self._post("/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path,
                                                       "pinned": pinned})
        if not body.get("success", False):  # LoRAUpdateOutput: success, error_message, loaded_adapters
            raise WeightSyncError(f"{self.url}/load_lora_adapter: {body.get('error_message')}")
        return body

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        body = await self._post("/unload_lora_adapter", {"lora_name": lora_name})
        if not body.get("success", False):
            raise WeightSyncError(f"{self.url}/unload_lora_adapter: {body.get('error_message')}")
        return body

    async def update_weight_version(self, version: int) -> None:
        """The server's weight version (what /generate reports) moved without a weight load (a LoRA sync)."""
        await self._post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self._version = int(version)

    async def sync_lora_adapters(self, folders: dict[str, str], version: int) -> None:
        """Serve ``folders`` (adapter name -> peft folder) as ``version``: each name unloaded if it is loaded
        (SGLang refuses a name twice), then loaded from its folder."""
        loaded = dict(self._loras)
        for name, folder in folders.items():
            if name in loaded:
                await self.unload_lora_adapter(name)
            body = await self.load_lora_adapter(name, folder)
            self._loras = dict(body.get("loaded_adapters") or {name: folder})
        await self.update_weight_version(version)

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get("/get_model_info")

    # -- HTTP ----------------------------------------------------------------------------------------
    def _announce_lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    def _http(self) -> aiohttp.ClientSession:
        """One session per event loop (the driver may run each phase under its own ``asyncio.run``)."""
        aiohttp = _aiohttp()
        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            self._session_loop = loop
        return self._session

    async def _request(self, method: str, path: str, payload: Any) -> tuple[int, Any]:
        aiohttp = _aiohttp()
        url = f"{self.url}{path}"
        try:
            async with self._http().request(method, url, json=payload,
                                            timeout=aiohttp.ClientTimeout(total=self.control_timeout_s)) as r:
                return r.status, _json_or_text(await r.text())
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise WeightSyncError(f"SGLang server {url} is unreachable ({type(e).__name__}: {e}); "
                                  "is it running? (check its log)") from e

    async def _post(self, path: str, payload: Any) -> Any:
        status, body = await self._request("POST", path, payload)
        if status != 200:
            raise WeightSyncError(f"{self.url}{path} answered HTTP {status}: {_error_message(body)}")
        return body

    async def _get(self, path: str) -> Any:
        status, body = await self._request("GET", path, None)
        if status != 200:
            raise WeightSyncError(f"{self.url}{path} answered HTTP {status}: {_error_message(body)}")
        return body

    async def _weights(self, path: str, payload: dict[str, Any], weight_version: str | None) -> Any:
        """A weight request: ``{"success", "message"}``; a failure raises naming the server's message."""
        status, body = await self._request("POST", path, payload)
        ok = status == 200 and (not isinstance(body, dict) or body.get("success", True))
        if not ok:
            raise WeightSyncError(f"{self.url}{path} failed (HTTP {status}): {_error_message(body)}")
        if weight_version is not None:
            self._version = int(weight_version)
        return body

    def _pick(self) -> str:
        """The next generate target, round-robin over those not marked down (all, when every one is)."""
        up = [u for u in self.generate_urls if u not in self._down] or self.generate_urls
        return up[next(self._turn) % len(up)]

    def _engine_error(self, message: str, prompt_len: int) -> Completion:
        self.stats["engine_errors"] += 1
        self.stats["aborted"] += 1
        return Completion(output_ids=[], output_logprobs=[], finish_reason=FinishReason.ABORT,
                          weight_version=self._version, prompt_tokens=prompt_len,
                          meta={"error": message, "weight_versions": []})


def _aiohttp():  # noqa: ANN202 - the module
    return require("aiohttp", "proxy", "the SGLang rollout backend (rollout.engine=sglang)")


def _json_or_text(text: str) -> Any:
    """A JSON body, or the text itself (``/flush_cache`` and FastAPI's 500s answer plain text)."""
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _error_message(body: Any) -> str:
    """SGLang's error shapes: ``{"error": {"message"}}``, ``{"error": "..."}``, ``{"message"}``,
    FastAPI's ``{"detail"}``, or plain text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        for key in ("message", "detail", "error_message"):
            if body.get(key):
                return str(body[key])
        return str(err or body)
    return str(body or "(empty body)").strip()
