"""Rollout engines (installed as miles_agent.engines, entry-point group ``miles_agent.engines``).

Each entry point is a function ``build_engines(cfg, model, tokenizer) -> list[RolloutEngine]``: the
engines of one run in this process. Episodes go through the first one. Under ``cluster.mode=ray`` the
Ray runtime (``runtime/``) places the same engines as actors instead.
"""
