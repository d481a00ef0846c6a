"""Which weights a run starts from: an HF folder, the environment's warm start, or a fresh tiny model."""

from __future__ import annotations

import logging
from typing import Any

from miles_agent.config import Config
from miles_agent.environment import Environment
from miles_agent.models.builder import build_tiny, load_hf

log = logging.getLogger(__name__)


def load_policy(cfg: Config, env: Environment) -> tuple[Any, Any]:
    """(model, tokenizer) for the policy, on ``cfg.model.device``."""
    m = cfg.model
    if m.hf_checkpoint:
        model, tokenizer = load_hf(m.hf_checkpoint, m.dtype)
    elif m.warm_start == "builtin" and hasattr(env, "demonstrator"):
        from miles_agent.warmstart import ensure_warm_start

        model, tokenizer = load_hf(ensure_warm_start(env, m.arch), m.dtype)
    elif m.warm_start == "builtin":
        log.warning("environment %r ships no warm start: starting from a randomly initialised %s "
                    "(pass --hf-checkpoint DIR to start from a trained model)", env.name, m.arch)
        model, tokenizer = build_tiny(m.arch, seed=cfg.run.seed, dtype=m.dtype)
    elif m.warm_start:
        model, tokenizer = load_hf(m.warm_start, m.dtype)
    else:
        model, tokenizer = build_tiny(m.arch, seed=cfg.run.seed, dtype=m.dtype)
    from miles_agent.tito import with_chat_options
    from miles_agent.tool_calls import choose_format

    fmt = choose_format(m.family, getattr(model, "config", None))
    return model.to(m.device), with_chat_options(tokenizer, m.chat_template_kwargs, fmt)
