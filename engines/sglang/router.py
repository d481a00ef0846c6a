"""Registering servers with SGLang's router (sglang_router): ``POST /add_worker?url=<worker>`` and
``POST /remove_worker?url=<worker>``. Synchronous: it runs while the engines are built or torn down."""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request


class RouterError(RuntimeError):
    pass


def _call(router_url: str, route: str, worker_url: str, timeout_s: float) -> None:
    url = f"{router_url.rstrip('/')}/{route}?url={urllib.parse.quote(worker_url, safe='')}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=timeout_s) as r:
            r.read()
    except urllib.error.HTTPError as e:
        raise RouterError(f"router {router_url} refused {route} for {worker_url}: HTTP {e.code} "
                          f"{e.read().decode(errors='replace')[:300]}") from e
    except (urllib.error.URLError, OSError) as e:
        raise RouterError(f"router {router_url} is unreachable ({e}); is sglang_router running there "
                          "(sglang.router_url)?") from e


def add_worker(router_url: str, worker_url: str, timeout_s: float = 30.0) -> None:
    _call(router_url, "add_worker", worker_url, timeout_s)


def remove_worker(router_url: str, worker_url: str, timeout_s: float = 30.0) -> None:
    _call(router_url, "remove_worker", worker_url, timeout_s)
