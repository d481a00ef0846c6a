"""A fake SGLang server for the tests: SGLang's HTTP routes, payloads and status codes, backed by the
embedded EmbeddedEngine on a tiny model, so generations, logprobs and routed experts are real.

Keyed to sglang 0.5.x source (``pip download --no-deps sglang``):
* routes and status codes: sglang/srt/entrypoints/http_server.py (``generate_request``,
  ``health_generate``, ``flush_cache``, ``pause_generation``, ``continue_generation``,
  ``update_weights_from_*``, ``init_weights_update_group``, ``release/resume_memory_occupation``,
  ``load_lora_adapter``, ``get_model_info``); errors via ``_create_error_response`` ->
  ``{"error": {"message"}}`` with status 400.
* request fields: sglang/srt/managers/io_struct.py (GenerateReqInput, PauseGenerationReqInput.mode,
  UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput -- base64 ``serialized_named_tensors``,
  InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, Release/ResumeMemoryOccupation
  ReqInput.tags, LoadLoRAAdapterReqInput -> LoRAUpdateOutput).
* response fields: sglang/srt/managers/tokenizer_manager.py (meta_info ``id``, ``finish_reason``,
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version``, ``num_retractions``,
  ``output_token_logprobs`` as ``[logprob, token_id, text]``, ``routed_experts`` base64 int32);
  sglang/srt/utils/weight_versions.py (``weight_versions`` spans ``{version, start, end}``);
  sglang/srt/managers/schedule_batch.py (FINISH_MATCHED_TOKEN / FINISH_LENGTH / FINISH_ABORT ``to_json``).

Run: ``python fake_sglang_server.py --model-path DIR|tiny-qwen3|tiny-qwen3-moe --host 127.0.0.1 --port P
[--decode-delay-s S] [any other --sglang-argument ...]``; it prints ``READY <port>`` once it serves.
Not SGLang: ``/_fake/state`` (what the tests inspect), ``--decode-delay-s`` (keeps requests in flight) and
``--ignore-eos`` (full-length outputs, so a pause always lands mid-request).

Memory occupation (scheduler_update_weights_mixin.py, torch_memory_saver): release asserts an idle server
(requests retracted by a pause may wait); with ``--enable-memory-saver`` the released memory is really
unmapped, so the fake refuses what would crash or corrupt a real server -- generating or continuing with
the weights or the KV cache released, writing weights into released memory -- and, without
``--enable-weights-cpu-backup``, generating from weights that were released and not loaded since (their
pages come back with undefined contents). Every control call is logged in order (``events``), and
every refusal counted (``refused``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from miles_agent.engine import FinishReason, PauseMode, SamplingParams
from miles_agent.engines.embedded.engine import EmbeddedEngine
from miles_agent.transports.receiver import InProcessReceiver

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang GPU_MEMORY_TYPE_* tags


def error(message: str, status: int = 400) -> web.Response:
    """http_server._create_error_response."""
    return web.json_response({"error": {"message": message}}, status=status)


class FakeSGLang:
    def __init__(self, engine: EmbeddedEngine, model_path: str, server_args: dict[str, Any]) -> None:
        self.engine = engine
        self.receiver = InProcessReceiver(engine)
        self.model_path = model_path
        self.server_args = server_args
        self.released: set[str] = set()
        self.memory_saver = bool(server_args.get("enable_memory_saver"))
        self.weights_lost = False  # released under the memory saver without a CPU backup, not reloaded since
        self.events: list[dict[str, Any]] = []  # control calls in order; runs of /generate collapsed
        self.refused = 0
        self.loras: dict[str, str] = {}
        self.requests = 0
        self.updates: list[dict[str, Any]] = []  # every weight request, for the tests
        self.model_update_lock = asyncio.Lock()  # TokenizerManager.model_update_lock: one update at a time

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        r.add_post("/update_weights_from_disk", self.weights("update_weights_from_disk", disk=True))
        r.add_post("/update_weights_from_tensor", self.weights("update_weights_from_tensor"))
        r.add_post("/init_weights_update_group", self.weights("init_weights_update_group"))
        r.add_post("/update_weights_from_distributed", self.weights("update_weights_from_distributed"))
        r.add_post("/destroy_weights_update_group", self.weights("destroy_weights_update_group"))
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_post("/load_lora_adapter", self.load_lora)
        r.add_post("/unload_lora_adapter", self.unload_lora)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/_fake/state", self.state)
        return app

    # -- /generate ---------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "input_ids" not in body:  # this fake serves token ids only (skip_tokenizer_init style)
            return error("the fake server needs input_ids (text prompts are not implemented)")
        if not self.engine._paused:  # a paused server only queues the request: it runs after continue
            if "weights" in self.released:
                return self.refuse("weights are released (release_memory_occupation); resume them first")
            if "kv_cache" in self.released:
                return self.refuse("the KV cache is released (release_memory_occupation); resume it first")
            if self.weights_lost:
                return self.refuse("the weights were released without --enable-weights-cpu-backup and not "
                                   "loaded since; load weights after resume_memory_occupation")
        sp = dict(body.get("sampling_params") or {})
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "sampling_seed"}
        if set(sp) - known:
            return error(f"unsupported sampling params in the fake: {sorted(set(sp) - known)}")
        lora = body.get("lora_path")  # GenerateReqInput.lora_path: a loaded adapter's name
        if lora is not None and lora not in self.loras:
            return error(f"The following requested LoRA adapters are not loaded: {lora}")
        try:
            sampling = SamplingParams(lora_path=lora, max_new_tokens=sp.get("max_new_tokens", 128),
                                      temperature=sp.get("temperature", 1.0), top_p=sp.get("top_p", 1.0),
                                      top_k=sp.get("top_k", -1), stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                                      stop=tuple(sp.get("stop") or ()), seed=sp.get("sampling_seed"))
            self.requests += 1
            self.log("generate")
            images = self.images(body)  # like SGLang's multimodal processor: one expanded pad run per image
            c = await self.engine.generate(body["input_ids"], sampling,
                                           return_routed_experts=bool(body.get("return_routed_experts")),
                                           **({"images": images} if images else {}))
        except ValueError as e:  # SGLang validates in the tokenizer manager and answers 400
            return error(str(e))
        n = len(c.output_ids)
        if c.finish_reason is FinishReason.STOP:
            fr: dict[str, Any] = {"type": "stop", "matched": c.meta.get("matched_stop", c.output_ids[-1])}
        elif c.finish_reason is FinishReason.LENGTH:
            fr = {"type": "length", "length": n}
        else:
            fr = {"type": "abort", "message": "Abort in waiting queue", "status_code": None}
        spans = c.meta.get("weight_versions") or [(c.weight_version, 0)]
        meta: dict[str, Any] = {
            "id": str(c.meta.get("rid")), "finish_reason": fr, "prompt_tokens": c.prompt_tokens,
            "weight_version": str(c.weight_version), "num_retractions": c.meta.get("retractions", 0),
            "completion_tokens": n, "cached_tokens": 0, "reasoning_tokens": 0,
            "weight_versions": [{"version": str(v), "start": s, "end": spans[i + 1][1] if i + 1 < len(spans) else n}
                                for i, (v, s) in enumerate(spans)],
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(c.output_logprobs, c.output_ids)]
            meta["output_token_logprobs_length"] = n
        if c.routed_experts is not None:  # detokenizer _b64_encode_per_request: raw int32 bytes
            meta["routed_experts"] = base64.b64encode(c.routed_experts.astype("int32").tobytes()).decode()
        text = self.engine.tokenizer.decode(c.output_ids) if self.engine.tokenizer is not None else ""
        return web.json_response({"text": text, "output_ids": c.output_ids, "meta_info": meta})

    def images(self, body: dict[str, Any]) -> list[Any]:
        """``image_data`` (base64 data URLs, in order) matched to the runs of the model's image token id."""
        from miles_agent.engines.sglang.wire import decode_image_data
        from miles_agent.models.vision import vision_token_ids
        from miles_agent.tito import image_inputs
        from miles_agent.types import TrajectoryError

        data = body.get("image_data") or []
        if not data:
            return []
        vision = vision_token_ids(self.engine.model)
        if vision is None:
            raise ValueError(f"image_data sent to {self.model_path}, which is not a multimodal model")
        try:
            return image_inputs(body["input_ids"], vision[0], decode_image_data(data))
        except TrajectoryError as e:
            raise ValueError(f"image_data does not match the prompt's image tokens: {e}") from None

    # -- health and info -----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if await self.engine.health() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": str(self.engine.weight_version)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.server_args, "model_path": self.model_path,
                                  "weight_version": str(self.engine.weight_version)})

    async def state(self, request: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"running": len(e._running), "waiting": len(e._waiting), "paused": e._paused,
                                  "generated_tokens": e.stats["generated_tokens"], "requests": self.requests,
                                  "released": sorted(self.released), "loras": self.loras,
                                  "weight_version": e.weight_version, "updates": self.updates,
                                  "events": self.events, "refused": self.refused,
                                  "weights_lost": self.weights_lost})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """200 "Cache flushed..." when idle, else 400 (SGLang refuses with running or waiting requests)."""
        if self.engine._running or self.engine._waiting:
            return web.Response(text="Flush cache failed: there are running or waiting requests.\n", status=400)
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")

    # -- pause / continue --------------------------------------------------------------------------
    async def pause(self, request: web.Request) -> web.Response:
        body = await _json(request)
        mode = body.get("mode", "abort")  # PauseGenerationReqInput default: abort
        self.log("pause_generation", mode=mode)
        await self.engine.pause(PauseMode(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.log("continue_generation")
        pending = len(self.engine._running) + len(self.engine._waiting)
        if pending and self.memory_saver and (self.released & {"weights", "kv_cache"} or self.weights_lost):
            return self.refuse(f"continuing {pending} requests with {sorted(self.released)} released (weights "
                               f"lost: {self.weights_lost}) would touch unmapped or undefined memory", status=500)
        await self.engine.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # -- weights -----------------------------------------------------------------------------------
    def weights(self, method: str, disk: bool = False):  # noqa: ANN202 - an aiohttp handler
        async def handle(request: web.Request) -> web.Response:
            body = await _json(request)
            for extra in ("abort_all_requests", "is_async", "torch_empty_cache", "keep_pause", "selector",
                          "recapture_cuda_graph", "token_step", "manifest"):
                body.pop(extra, None)  # SGLang options this fake does not model
            if method == "update_weights_from_disk":
                body.pop("flush_cache", None)
            self.updates.append({"endpoint": method, "weight_version": body.get("weight_version"),
                                 "running": len(self.engine._running), "paused": self.engine._paused})
            self.log(method, weight_version=body.get("weight_version"))
            if "weights" in self.released and method.startswith("update_weights"):
                self.refused += 1
                return web.json_response({"success": False, "message": "the weights' memory is released "
                                          "(release_memory_occupation); resume_memory_occupation(['weights']) "
                                          "first"}, status=400)
            try:
                async with self.model_update_lock:
                    await getattr(self.receiver, method)(**body)
            except Exception as e:  # noqa: BLE001 - SGLang reports every failure as success: false
                content: dict[str, Any] = {"success": False, "message": f"{type(e).__name__}: {e}"}
                if disk:
                    content["num_paused_requests"] = 0
                return web.json_response(content, status=400)
            if method.startswith("update_weights"):
                self.weights_lost = False
            content = {"success": True, "message": "Succeeded to update model weights."}
            if disk:
                content["num_paused_requests"] = 0
            return web.json_response(content)
        return handle

    # -- memory and LoRA ---------------------------------------------------------------------------
    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await _json(request)).get("tags") or list(MEMORY_TAGS)
        self.log("release_memory_occupation", tags=tags)
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            return error(f"unknown memory tags {bad}")
        # SGLang asserts an idle scheduler; requests a pause retracted may wait (is_fully_idle(ignore_retracted))
        if self.engine._running or (self.engine._waiting and not self.engine._paused):
            return self.refuse("release_memory_occupation needs an idle server: pause in abort or retract "
                               "mode first")
        if "kv_cache" in tags:
            self.engine.runner.release()  # really drops the KV cache; the runner regrows it on demand
        if "weights" in tags and self.memory_saver and not self.server_args.get("enable_weights_cpu_backup"):
            self.weights_lost = True
        self.released |= set(tags)
        return web.json_response(None)  # the route returns None -> 200 "null"

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await _json(request)).get("tags") or list(MEMORY_TAGS)
        self.log("resume_memory_occupation", tags=tags)
        self.released -= set(tags)
        return web.json_response(None)

    def log(self, call: str, **details: Any) -> None:
        if call == "generate" and self.events and self.events[-1]["call"] == "generate":
            self.events[-1]["n"] += 1
            return
        self.events.append({"call": call, "t": time.monotonic(), **details,
                            **({"n": 1} if call == "generate" else {})})

    def refuse(self, message: str, status: int = 400) -> web.Response:
        self.refused += 1
        return error(message, status)

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await _json(request)
        path = Path(body["lora_path"])
        name = body["lora_name"]
        if not (path / "adapter_config.json").is_file():
            return self.lora_failure(f"no adapter_config.json in {path}")
        if name in self.loras:  # LoRARegistry.register refuses a name twice: unload it first
            return self.lora_failure(f"The LoRA adapter {name} is already loaded.")
        if (path / "adapter_model.safetensors").is_file():  # served for real, unmerged, per request
            self.serve_adapter(name, path)
        self.loras[name] = str(path)
        self.log("load_lora_adapter", name=name)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loras)})

    def lora_failure(self, message: str) -> web.Response:
        return web.json_response({"success": False, "error_message": message, "loaded_adapters": dict(self.loras)},
                                 status=400)

    def serve_adapter(self, name: str, path: Path) -> None:
        """peft's files into the embedded engine's unmerged LoRA layers (engines/embedded/lora.py)."""
        import json

        from safetensors.torch import load_file

        from miles_agent.engines.embedded import lora

        cfg = json.loads((path / "adapter_config.json").read_text())
        rows = getattr(self.engine, "lora_rows", None)
        if rows is None:
            rows = lora.AdapterRows([])
            lora.attach(self.engine, rows)
        targets = cfg["target_modules"]
        lora.add_adapter(self.engine.model, rows, name, cfg["r"], cfg["lora_alpha"] / cfg["r"],
                         sorted(targets) if isinstance(targets, list) else [targets])
        tensors = [(k.removeprefix("base_model.model.").replace(".lora_A.", f".lora_A.{name}.")
                    .replace(".lora_B.", f".lora_B.{name}."), t) for k, t in load_file(str(path / "adapter_model.safetensors")).items()]
        self.engine.runner.load_weights(tensors)

    async def unload_lora(self, request: web.Request) -> web.Response:
        name = (await _json(request))["lora_name"]
        if name not in self.loras:
            return self.lora_failure(f"LoRA adapter {name} is not loaded.")
        del self.loras[name]
        self.log("unload_lora_adapter", name=name)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.loras)})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json(request)  # UpdateWeightVersionReqInput: new_version, abort_all_requests
        self.engine._version = int(body["new_version"])
        self.log("update_weight_version", version=body["new_version"])
        return web.json_response({"success": True, "message": f"Weight version updated to {body['new_version']}"})


async def _json(request: web.Request) -> dict[str, Any]:
    return (await request.json()) if request.can_read_body else {}


def _slow_steps(engine: EmbeddedEngine, delay_s: float) -> None:
    """Sleep in every scheduler step, so tests can catch requests in flight."""
    step = engine._step

    def slow(admitted):  # noqa: ANN001, ANN202
        time.sleep(delay_s)
        return step(admitted)
    engine._step = slow


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--decode-delay-s", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to max_new_tokens")
    args, rest = p.parse_known_args(argv)
    server_args: dict[str, Any] = {}  # every other SGLang argument, recorded for /get_server_info
    key = None
    for tok in rest:
        if tok.startswith("--"):
            key = tok[2:].replace("-", "_")
            server_args[key] = True
        elif key is not None:
            server_args[key] = tok if server_args[key] is True else [*([server_args[key]] if not
                                                                       isinstance(server_args[key], list) else
                                                                       server_args[key]), tok]
    torch.set_num_threads(1)
    if args.model_path.startswith("tiny-"):
        from miles_agent.models.builder import build_tiny

        model, tok = build_tiny(args.model_path)
    else:
        from miles_agent.models.builder import load_hf

        model, tok = load_hf(args.model_path)
    engine = EmbeddedEngine(model, tok, max_batch_size=32)
    if args.ignore_eos:
        engine.eos_ids = frozenset()
    if args.decode_delay_s:
        _slow_steps(engine, args.decode_delay_s)
    fake = FakeSGLang(engine, args.model_path, server_args)

    async def serve() -> None:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"READY {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1:])
