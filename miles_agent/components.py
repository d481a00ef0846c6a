"""Which trainer, engines and weight transport a config asks for, built where ``cluster.mode`` says.

A cluster mode is a plug-in (entry-point group ``miles_agent.clusters``): ``inprocess`` (below: every
part in this process) or ``ray`` (``runtime/``: trainer ranks and engines as Ray actors). A mode is a
class built from the config; the run calls its three methods in order -- trainer, engines, transport --
and the mode keeps what the three share (Ray's placement group) on itself. Backends are found by name
in the registry: ``train.backend`` (trainers), ``rollout.engine`` (engines), ``sync.transport``
(transports), so the loop never learns which ones it drives.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from miles_agent import registry
from miles_agent.config import Config
from miles_agent.errors import UserError

log = logging.getLogger(__name__)

OFFLOAD_CHOICES = ("auto", True, False)


class Cluster(Protocol):
    """Where a run's parts live. ``cls(cfg)`` then trainer, engines, transport, in that order; an
    optional ``cls.check(cfg)`` refuses a choice it cannot build before anything loads (build.check_choices)."""

    def trainer(self, model: Any, tokenizer: Any) -> Any: ...

    def engines(self, model: Any, tokenizer: Any) -> list[Any]:
        """The rollout engines; ``model`` is the engines' own copy of the policy (not the trainer's)."""
        ...

    def transport(self, trainer: Any, engines: list[Any]) -> Any: ...


def cluster_for(cfg: Config) -> Cluster:
    """The ``cluster.mode`` plug-in for this config (checks that hold in every mode come first)."""
    consistency = [name for name, on in (("routing_replay", cfg.algo.routing_replay),
                                         ("true_on_policy", cfg.algo.true_on_policy)) if on]
    if consistency and cfg.train.backend != "fsdp2":
        raise UserError(f"algo.{consistency[0]} is implemented by the fsdp2 trainer only; set "
                        f"train.backend=fsdp2 or algo.{consistency[0]}=false")
    return registry.load("clusters", cfg.cluster.mode, key="cluster.mode")(cfg)


def build_trainer(cfg: Config, model: Any, tokenizer: Any) -> Any:
    """The trainer alone (SFT, replay): a cluster mode's first part."""
    return cluster_for(cfg).trainer(model, tokenizer)


class InProcessCluster:
    """``cluster.mode=inprocess``: the trainer, the engines and the weight transport in this process."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @staticmethod
    def check(cfg: Config) -> None:
        transport_builder(cfg)

    def trainer(self, model: Any, tokenizer: Any) -> Any:
        cfg = self.cfg
        offload_enabled(cfg.train.offload, colocate=cfg.cluster.colocate, mode=cfg.cluster.mode)  # true is refused
        return registry.load("trainers", cfg.train.backend, key="train.backend")(
            model, tokenizer, cfg.train, cfg.algo, temperature=cfg.rollout.temperature, device=cfg.model.device,
            **trainer_extra(cfg))

    def engines(self, model: Any, tokenizer: Any) -> list[Any]:
        return registry.load("engines", self.cfg.rollout.engine, key="rollout.engine")(self.cfg, model, tokenizer)

    def transport(self, trainer: Any, engines: list[Any]) -> Any:
        return build_transport(self.cfg, engines)


def transport_builder(cfg: Config) -> Any:
    """The ``sync.transport`` plug-in for engines the driver talks to itself (``auto`` = ``inprocess``)."""
    name = "inprocess" if cfg.sync.transport == "auto" else cfg.sync.transport
    if name == "object-store":
        raise UserError("sync.transport=object-store sends weights through Ray's object store: it needs "
                        "cluster.mode=ray; in one process use sync.transport=inprocess, shm, distributed or disk")
    return registry.load("transports", name, key="sync.transport")


def build_transport(cfg: Config, engines: list[Any]) -> Any:
    """The ``sync.transport`` plug-in over these engines."""
    return transport_builder(cfg)(cfg.sync, engines, run_dir=cfg.run.run_dir, device=cfg.model.device)


def build_critic(cfg: Config, model: Any, tokenizer: Any) -> Any:
    """The value model's trainer when the estimator needs one (``algo.advantage=gae``), else None.
    Call it before the trainer: it copies the policy's backbone before the trainer shards it."""
    from miles_agent.algorithms.estimators import needs_critic

    if not needs_critic(cfg.algo):
        return None
    return registry.load("critics", "value-head")(model, tokenizer, cfg.train, cfg.algo, device=cfg.model.device)


def trainer_extra(cfg: Config) -> dict[str, Any]:
    """A trainer that owns the config section of its own name (``megatron``) gets it as the keyword
    argument of that name, in-process or on Ray ranks."""
    name = cfg.train.backend
    extra = {name: cfg.sections[name]} if name in cfg.sections else {}
    if getattr(cfg.sections.get("lora"), "enabled", False):  # lora.rank > 0: the trainer gets the section
        extra["lora"] = cfg.sections["lora"]
    return extra


def offload_enabled(offload: bool | str, *, colocate: bool, mode: str) -> bool:
    """``train.offload``: ``auto`` = on exactly when trainer ranks share devices with engines
    (``cluster.mode=ray`` and ``cluster.colocate=true``)."""
    if offload not in OFFLOAD_CHOICES:
        raise UserError(f"train.offload must be auto, true or false, got {offload!r}")
    if offload == "auto":
        return mode == "ray" and colocate
    if offload and mode != "ray":
        raise UserError("train.offload=true frees the trainer ranks' devices between steps, which only Ray trainer "
                        "ranks do (cluster.mode=ray, usually with cluster.colocate=true); set train.offload=auto")
    return bool(offload)
