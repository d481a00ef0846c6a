"""The embedded engine (``rollout.engine=embedded``): an in-process torch engine with continuous batching.

* `engine.EmbeddedEngine` -- the `RolloutEngine` itself (scheduler, KV-cache slots, pause modes, weights).
* `model_runner.ModelRunner` -- the batched forward with a KV cache (prefill, decode, scoring).
* `sequence`, `sampling` -- one request's state; temperature / top-p / top-k sampling.
* `process.EngineProcess` -- the same engine in a child process, driven through SGLang's weight API.
"""

from __future__ import annotations

from typing import Any

from miles_agent.errors import UserError


def build_engines(cfg: Any, model: Any, tokenizer: Any) -> list[Any]:
    """The embedded torch engine: one in-process engine on ``model.device`` (the CPU default)."""
    from miles_agent.engines.embedded import quant
    from miles_agent.engines.embedded.engine import EmbeddedEngine

    if cfg.rollout.prefix_cache_mb < 0:
        raise UserError(f"rollout.prefix_cache_mb={cfg.rollout.prefix_cache_mb} is negative; set a size in MiB, "
                        "or 0 to turn the embedded engine's prefix cache off")

    lora = getattr(cfg, "sections", {}).get("lora")
    fmt = quant.check_format(cfg.rollout.weight_format)
    if lora is not None and lora.enabled and fmt not in ("auto", "bf16"):
        raise UserError(f"rollout.weight_format={fmt} with lora.rank > 0 is not implemented in the embedded "
                        "engine (its LoRA layers hold the base weight unquantized); use one of the two")
    quant.install(model, fmt)  # fp8 / mxfp8 / int4: requantized at every sync
    rows = None
    if lora is not None and lora.enabled:  # unmerged adapters, one per request (engines/embedded/lora.py)
        from miles_agent.engines.embedded import lora as engine_lora

        rows = engine_lora.install(model, lora.names, lora.rank, lora.scaling, lora.targets)
    # The prefix cache is keyed by tokens alone: KV computed under one adapter is wrong for another, so
    # LoRA runs without it until the cache keys by adapter too.
    cache_bytes = 0 if rows is not None else cfg.rollout.prefix_cache_mb << 20
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size, device=cfg.model.device,
                            true_on_policy=cfg.algo.true_on_policy, prefix_cache_bytes=cache_bytes)
    if rows is not None:
        engine_lora.attach(engine, rows)
    return [engine]
