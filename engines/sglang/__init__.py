"""The SGLang rollout backend (``rollout.engine=sglang``): SGLang servers behind the `RolloutEngine` contract.

* `client.SGLangEngine` -- one server's HTTP API (generate, pause/continue, weights, memory, LoRA).
* `server.SGLangServer` -- launch and supervise a server process (the seam a Ray actor will own).
* `router` -- register servers with sglang_router.
* `wire` -- the ``/generate`` payloads, including base64 routed experts for R3.

`build_engines` (the ``sglang`` entry point of ``miles_agent.engines``) turns the ``sglang`` config section into one client per server: it attaches to
``sglang.external_urls`` when given, else launches ``sglang.num_servers`` servers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_agent.errors import UserError


def launch_args(sg: Any) -> dict[str, Any]:
    """The server arguments: ``server_args`` verbatim plus the typed keys that are set."""
    args = dict(sg.server_args)
    if sg.tp_size != 1:
        args.setdefault("tp_size", sg.tp_size)
    if sg.mem_fraction_static is not None:
        args.setdefault("mem_fraction_static", sg.mem_fraction_static)
    return args


def client_options(cfg: Any, model: Any = None) -> dict[str, Any]:
    sg = cfg.sglang
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return dict(request_timeout_s=sg.request_timeout_s, control_timeout_s=sg.control_timeout_s,
                routed_top_k=int(top_k) if top_k else None)


def model_folder(cfg: Any, model: Any = None, tokenizer: Any = None) -> str:
    """The HF folder servers load: ``model.hf_checkpoint``, or the run's initial policy written once."""
    return cfg.model.hf_checkpoint or _save_initial(cfg, model, tokenizer)


def build_engines(cfg: Any, model: Any = None, tokenizer: Any = None) -> list[Any]:
    """SGLang servers over HTTP: attach to ``sglang.external_urls`` or launch ``sglang.num_servers``."""
    from miles_agent.engines.sglang.client import SGLangEngine
    from miles_agent.engines.sglang.server import DEFAULT_LAUNCH, SGLangServer, server_argv
    from miles_agent.transports.groups import free_ports

    if getattr(cfg.sections.get("lora"), "enabled", False):
        from miles_agent.errors import UserError

        raise UserError("lora.rank > 0 with rollout.engine=sglang: the run loop has no adapter transport for "
                        "SGLang yet (SGLangEngine.sync_lora_adapters loads peft folders by hand, docs/lora.md); "
                        "use rollout.engine=embedded for LoRA runs")
    sg = cfg.sglang
    client = client_options(cfg, model)
    if sg.external_urls:
        engines = [SGLangEngine(url, **client) for url in sg.external_urls]
    else:
        model_path = model_folder(cfg, model, tokenizer)
        engines = []
        try:
            if sg.base_port:
                ports = [sg.base_port + i for i in range(sg.num_servers)]
            else:  # picked together, so no two servers are handed the same one
                ports = free_ports(sg.num_servers, sg.host)
            for i, port in enumerate(ports):
                url = f"http://{sg.host}:{port}"
                argv = server_argv(sg.launch_command or DEFAULT_LAUNCH, model_path, sg.host, port, launch_args(sg))
                server = SGLangServer(argv, url, Path(cfg.run.run_dir) / "sglang" / f"server{i}.log")
                server.start()
                engines.append(SGLangEngine(url, process=server, **client))
            for e in engines:
                e.process.wait_ready(sg.startup_timeout_s)
        except BaseException:
            for e in engines:
                e.process.stop()
            raise
    return connect_clients(cfg, engines)


def connect_clients(cfg: Any, engines: list[Any]) -> list[Any]:
    """Episodes go through engines[0] (the loop's policy): it spreads requests over every server, or
    through the router, with which every server is registered."""
    from miles_agent.engines.sglang import router

    sg = cfg.sglang
    targets = [sg.router_url] if sg.router_url else [e.url for e in engines]
    for e in engines:
        e.generate_urls = [t.rstrip("/") for t in targets]
    if sg.router_url:
        for e in engines:
            router.add_worker(sg.router_url, e.url)
            e.router_url = sg.router_url
    return engines


def _save_initial(cfg: Any, model: Any, tokenizer: Any) -> str:
    """SGLang loads a model from an HF folder: write the run's initial policy once, under the run dir."""
    if model is None or tokenizer is None:
        raise UserError("rollout.engine=sglang launches servers from an HF folder: set model.hf_checkpoint, "
                        "or attach to running servers with sglang.external_urls=[http://host:port]")
    from miles_agent.models.builder import save_hf

    path = Path(cfg.run.run_dir) / "sglang" / "initial_model"
    save_hf(model, tokenizer, path)
    return str(path.resolve())
