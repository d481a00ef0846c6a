"""The ``sglang`` config section, owned by the SGLang engine (entry point of ``miles_agent.sections``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_agent.errors import UserError


@dataclass(frozen=True)
class SGLangConfig:
    """SGLang servers for rollout.engine=sglang: attach to running ones or launch them (engines/sglang/)."""

    external_urls: list[str] = field(default_factory=list)  # attach to running servers; [] = launch them
    num_servers: int = 1  # servers to launch when external_urls is empty
    tp_size: int = 1  # --tp-size of each launched server
    mem_fraction_static: float | None = None  # --mem-fraction-static; None = SGLang's default
    server_args: dict[str, Any] = field(default_factory=dict)  # any other launch_server argument, verbatim
    router_url: str = ""  # register servers with this sglang_router and generate through it
    host: str = "127.0.0.1"  # where launched servers listen
    base_port: int = 0  # first port of launched servers; 0 = free ports
    launch_command: str = ""  # "" = <this python> -m sglang.launch_server
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 900.0  # one /generate; past it the request is aborted and the episode retried
    control_timeout_s: float = 600.0  # pause, weight updates, health

    def __post_init__(self) -> None:
        if not isinstance(self.external_urls, list) or not all(isinstance(u, str) for u in self.external_urls):
            raise UserError(f"sglang.external_urls must be a list of URLs, e.g. [http://127.0.0.1:30000], "
                            f"got {self.external_urls!r}")
        if not isinstance(self.server_args, dict):
            raise UserError(f"sglang.server_args must be a mapping of SGLang server arguments, e.g. "
                            f"{{tp_size: 2}}, got {self.server_args!r}")
        if self.num_servers < 1 or self.tp_size < 1:
            raise UserError("sglang.num_servers and sglang.tp_size must be >= 1")
