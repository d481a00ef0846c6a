"""The embedded engine (``rollout.engine=embedded``): an in-process torch engine with continuous batching.

* `engine.EmbeddedEngine` -- the `RolloutEngine` itself (scheduler, KV-cache slots, pause modes, weights).
* `model_runner.ModelRunner` -- the batched forward with a KV cache (prefill, decode, scoring).
* `sequence`, `sampling` -- one request's state; temperature / top-p / top-k sampling.
* `process.EngineProcess` -- the same engine in a child process, driven through SGLang's weight API.
"""

from __future__ import annotations

from typing import Any


def build_engines(cfg: Any, model: Any, tokenizer: Any) -> list[Any]:
    """The embedded torch engine: one in-process engine on ``model.device`` (the CPU default)."""
    from miles_agent.engines.embedded.engine import EmbeddedEngine
    from miles_agent.errors import UserError

    if cfg.rollout.prefix_cache_mb < 0:
        raise UserError(f"rollout.prefix_cache_mb={cfg.rollout.prefix_cache_mb} is negative; set a size in MiB, "
                        "or 0 to turn the embedded engine's prefix cache off")

    return [EmbeddedEngine(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size, device=cfg.model.device,
                           true_on_policy=cfg.algo.true_on_policy,
                           prefix_cache_bytes=cfg.rollout.prefix_cache_mb << 20)]
