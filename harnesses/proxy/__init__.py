"""An OpenAI-compatible proxy in front of any rollout engine, recording token-in-token-out trajectories.

An agent program talks to ``/sessions/{id}/v1`` with its own API key as it would to OpenAI; the proxy
renders each request with the model's chat template, appends only the new suffix to the session's
token history, and turns the session into `Trajectory` objects (one per branch of the conversation).

    async with ProxyServer(engine, tokenizer) as server:
        session = server.open_session()
        ...  # AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        trajectories = session.trajectories()

The HTTP server (aiohttp) is imported lazily: ``pip install 'miles-agent[proxy]'``.
"""

from miles_agent.harnesses.proxy.history import ProxyLimits, SessionHistory
from miles_agent.harnesses.proxy.server import ProxyServer
from miles_agent.harnesses.proxy.session import Session, ToolHost

__all__ = ["ProxyLimits", "ProxyServer", "Session", "SessionHistory", "ToolHost"]
