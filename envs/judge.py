"""Calling a remote judge over HTTP from a reward function (``env.reward=mypkg.rewards:judged``);
``from miles_agent.envs.judge import ask_judge``.

`ask_judge` POSTs a JSON payload and reads a score from the JSON reply, with a per-request timeout and
retries (exponential back-off) on connection errors, timeouts and 5xx replies; a 4xx reply is the
payload's fault and fails at once. A judge that stays down raises `JudgeError`, an infrastructure
error, so the episode is retried later and never scored 0 by an outage. Needs httpx (``[test]`` or
``[sglang]`` extras, or ``pip install httpx``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles_agent.errors import InfraError, require


class JudgeError(InfraError):
    """The judge could not be reached (after every retry) or gave no usable score."""


async def ask_judge(url: str, payload: dict[str, Any], *, timeout_s: float = 30.0, retries: int = 3,
                    backoff_s: float = 0.5, field: str = "score", headers: dict[str, str] | None = None,
                    client: Any = None) -> float:
    """``POST url`` with ``payload``; returns the reply's ``field`` as a float. ``client``: an
    ``httpx.AsyncClient`` to reuse (connection pooling across episodes), else one per call."""
    httpx = require("httpx", "test", "miles_agent.judge (a remote judge over HTTP)")
    own = client is None
    client = client or httpx.AsyncClient()
    last = ""
    try:
        for attempt in range(retries + 1):
            try:
                reply = await client.post(url, json=payload, headers=headers, timeout=timeout_s)
                if reply.status_code < 500:
                    reply.raise_for_status()  # 4xx: the request is wrong, retrying will not help
                    value = reply.json()[field]
                    return float(value)
                last = f"HTTP {reply.status_code}"
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last = f"{type(e).__name__}: {e}"
            except httpx.HTTPStatusError as e:
                raise JudgeError(f"judge {url} refused the request: HTTP {e.response.status_code} "
                                 f"{e.response.text[:200]}") from None
            except (KeyError, TypeError, ValueError) as e:
                raise JudgeError(f"judge {url} replied without a numeric {field!r}: {e}") from None
            if attempt < retries:
                await asyncio.sleep(backoff_s * 2 ** attempt)
        raise JudgeError(f"judge {url} failed {retries + 1} times (last: {last})")
    finally:
        if own:
            await client.aclose()
