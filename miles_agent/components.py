"""Which engine, trainer and weight transport a config asks for -- one place that maps config to parts.

The driver loop (miles_agent/loop.py) only calls these builders, so a new backend (Ray actors, SGLang
servers, Megatron, another transport) is added here and in its own module, never inside the loop.
"""

from __future__ import annotations

from typing import Any

from miles_agent import registry
from miles_agent.config import Config
from miles_agent.errors import UserError


def build_trainer(cfg: Config, model: Any, tokenizer: Any) -> Any:
    consistency = [name for name, on in (("routing_replay", cfg.algo.routing_replay),
                                         ("true_on_policy", cfg.algo.true_on_policy)) if on]
    if consistency and cfg.train.backend != "fsdp2":
        raise UserError(f"algo.{consistency[0]} is implemented by the fsdp2 trainer only; set "
                        f"train.backend=fsdp2 or algo.{consistency[0]}=false")
    if _on_ray(cfg):
        from miles_agent.runtime import launch

        return launch.build_trainer(cfg, model, tokenizer)
    from miles_agent.trainers.offload import offload_enabled

    offload_enabled(cfg.train.offload, colocate=cfg.cluster.colocate, mode=cfg.cluster.mode)  # true is refused here
    return registry.load("trainers", cfg.train.backend)(
        model, tokenizer, cfg.train, cfg.algo, temperature=cfg.rollout.temperature, device=cfg.model.device,
        **trainer_extra(cfg))


def build_critic(cfg: Config, model: Any, tokenizer: Any) -> Any:
    """The value model's trainer when the estimator needs one (``algo.advantage=gae``), else None.
    Call it before ``build_trainer``: it copies the policy's backbone before the trainer shards it."""
    from miles_agent.algorithms.estimators import needs_critic

    if not needs_critic(cfg.algo):
        return None
    from miles_agent.trainers.critic import CriticTrainer, ValueModel

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CriticTrainer(ValueModel(model), cfg.train, cfg.algo, pad_id=pad, device=cfg.model.device)


def build_engines(cfg: Config, model: Any, tokenizer: Any) -> list[Any]:
    """The rollout engines; ``model`` is the engine's own copy of the policy (not the trainer's)."""
    if _on_ray(cfg) and cfg.rollout.engine == "local":
        from miles_agent.runtime import launch

        return launch.build_engines(cfg, model, tokenizer)
    if _on_ray(cfg) and cfg.rollout.engine == "sglang" and not cfg.sglang.external_urls:
        from miles_agent.runtime.launch import session
        from miles_agent.runtime.sglang_actor import build_sglang_actor_engines

        return build_sglang_actor_engines(cfg, model, tokenizer, session(cfg))  # one server actor per bundle
    if cfg.rollout.engine == "sglang":
        from miles_agent.rollout.sglang import build_sglang_engines

        return build_sglang_engines(cfg, model, tokenizer)
    if cfg.rollout.engine != "local":
        raise UserError(f"rollout.engine {cfg.rollout.engine!r} is not available in this version; "
                        "use rollout.engine=local (the embedded engine) or sglang (SGLang servers)")
    from miles_agent.rollout.local import LocalEngine

    return [LocalEngine(model, tokenizer, max_batch_size=cfg.rollout.max_batch_size, device=cfg.model.device,
                        true_on_policy=cfg.algo.true_on_policy)]


def build_transport(cfg: Config, trainer: Any, engines: list[Any]) -> Any:
    """The weight transport ``cfg.sync`` names (inprocess, shm, distributed, disk) over these engines."""
    if _on_ray(cfg) and cfg.rollout.engine == "local":  # engine actors under the runtime's supervisor
        from miles_agent.runtime import launch

        return launch.build_transport(cfg, trainer, engines)
    from miles_agent.weight_sync.factory import build_transport as build

    if (_on_ray(cfg) and cfg.rollout.engine == "sglang" and not cfg.cluster.colocate and not cfg.sglang.external_urls
            and cfg.sync.transport == "distributed"):  # rank 0 broadcasts to the servers; the driver holds nothing
        from miles_agent.runtime.launch import rank0_options
        from miles_agent.runtime.rank0_sync import SGLangRankZeroTransport

        return SGLangRankZeroTransport(trainer, [e.url for e in engines], rank0_options(cfg))

    if _on_ray(cfg) and cfg.rollout.engine == "sglang" and cfg.cluster.colocate and not cfg.sglang.external_urls:
        from miles_agent.runtime.sglang_colocate import GatherFirst, memory_phased

        engines = memory_phased(engines, cfg.sglang.control_timeout_s)  # memory resumed inside the push's pause
        return GatherFirst(build(cfg.sync, engines, run_dir=cfg.run.run_dir, device=cfg.model.device))
    return build(cfg.sync, engines, run_dir=cfg.run.run_dir, device=cfg.model.device)


def trainer_extra(cfg: Config) -> dict[str, Any]:
    """Backend-specific trainer arguments (Megatron's parallel layout), in-process or on Ray ranks."""
    return {"megatron": cfg.megatron} if cfg.train.backend == "megatron" else {}


def _on_ray(cfg: Config) -> bool:
    """cluster.mode: ``local`` (one process) or ``ray`` (actors in placement groups, miles_agent.runtime)."""
    if cfg.cluster.mode not in ("local", "ray"):
        raise UserError(f"cluster.mode must be local or ray, got {cfg.cluster.mode!r}")
    return cfg.cluster.mode == "ray"
