"""``miles-agent plan``: where a recipe's actors go and what each GPU holds, before anything starts.

The placement follows runtime/ray_cluster.py: trainer rank ``r`` on GPU ``r`` (PACK, node by node); with
``cluster.colocate`` engine ``i`` shares the GPUs of ranks ``i*span .. (i+1)*span-1`` (``span`` = the
engine's tensor parallel size), otherwise engines take the GPUs after the trainer's. Memory comes from
runtime/memory_model.py and the model's config.json (the checkpoint's, else recipes/architectures/).
A plan that cannot run is refused with one line naming the fix (a `PlanError`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_agent.config import RECIPES_DIR, Config
from miles_agent.errors import UserError
from miles_agent.runtime.memory_model import GIB, Sharding, engine_memory, model_shape, train_memory

RESERVED_GIB = 2.0  # per GPU: CUDA context, NCCL buffers, allocator slack
SGLANG_DEFAULT_FRACTION = 0.85  # what the plan assumes when sglang.mem_fraction_static is unset


class PlanError(UserError):
    """The layout cannot run on the stated hardware; the message names the key to change."""


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Plan:
    hardware: Hardware
    gpus: list[list[str]]  # global GPU index -> the actors on it
    memory: list[tuple[str, float]]  # (what, GiB) on the busiest GPU
    peak_gib: float
    notes: list[str] = field(default_factory=list)


def architecture(cfg: Config) -> dict[str, Any]:
    """The model's config.json: the checkpoint's if it is here, else the copy in recipes/architectures/."""
    ckpt = cfg.model.hf_checkpoint
    if ckpt:
        for path in (Path(ckpt) / "config.json", RECIPES_DIR / "architectures" / f"{Path(ckpt).name}.json"):
            if path.is_file():
                return json.loads(path.read_text())
        raise PlanError(f"no config.json for {ckpt}: put the checkpoint there or add "
                        f"recipes/architectures/{Path(ckpt).name}.json (the model's config.json)")
    from miles_agent.models.builder import tiny_config
    from miles_agent.models.tokenizer import build_byte_tokenizer

    return tiny_config(cfg.model.arch, build_byte_tokenizer()).to_dict()


def engine_layout(cfg: Config) -> tuple[int, int]:
    """(engines, GPUs each spans): SGLang servers span their tensor parallel size, embedded engines one."""
    c = cfg.cluster
    if cfg.rollout.engine != "sglang":
        return c.num_engines, 1
    sg = cfg.sglang
    if c.num_engines != sg.num_servers:
        raise PlanError(f"sglang.num_servers={sg.num_servers} but cluster.num_engines={c.num_engines}: under "
                        f"cluster.mode=ray the servers launched are cluster.num_engines; set both to one number")
    return c.num_engines, sg.tp_size


def place(cfg: Config, hw: Hardware) -> tuple[list[list[str]], list[str]]:
    """GPU index -> actor labels, and notes; raises PlanError for a layout the GPUs cannot hold."""
    c, world = cfg.cluster, cfg.train.world_size
    notes: list[str] = []
    if c.mode != "ray":
        if world > 1:
            raise PlanError(f"train.world_size={world} needs {world} trainer ranks but cluster.mode={c.mode} runs one "
                            "process; set cluster.mode=ray (or train.world_size=1)")
        return [["trainer rank 0", "engine 0 (same process)"]], notes
    if c.trainer_gpus <= 0:
        raise PlanError("cluster.trainer_gpus=0 reserves no GPU for the trainer ranks; set cluster.trainer_gpus=1 "
                        "(or 0.5 with cluster.colocate=true and cluster.gpus_per_engine=0.5)")
    engines, span = engine_layout(cfg)
    if c.colocate:
        if c.trainer_gpus + c.gpus_per_engine > 1:
            raise PlanError(f"colocated cluster.trainer_gpus + cluster.gpus_per_engine = "
                            f"{c.trainer_gpus + c.gpus_per_engine:g} must fit one GPU; set both to 0.5")
        if engines * span > world:
            raise PlanError(f"{engines} colocated engines x {span} GPUs need {engines * span} trainer GPUs but "
                            f"train.world_size={world}; set cluster.num_engines={max(1, world // span)}")
        if span > hw.gpus_per_node and span % hw.gpus_per_node:
            raise PlanError(f"an engine of {span} GPUs spans nodes of {hw.gpus_per_node}: make sglang.tp_size a "
                            f"multiple of {hw.gpus_per_node} or at most {hw.gpus_per_node}")
        need = world
        gpus = [[f"trainer rank {r}"] for r in range(world)]
        for i in range(engines):
            for g in range(i * span, (i + 1) * span):
                gpus[g].append(f"engine {i}" + (f" (TP rank {g - i * span}/{span})" if span > 1 else ""))
        if span > hw.gpus_per_node:
            notes.append(f"each engine spans {span // hw.gpus_per_node} nodes: SGLang servers across nodes are not "
                         "launched under Ray yet (runtime/sglang_actor.py refuses them at start)")
    else:
        per_rank = max(1, round(1 / c.trainer_gpus)) if c.trainer_gpus < 1 else 1
        trainer_gpus = math.ceil(world / per_rank) * max(1, math.ceil(c.trainer_gpus))
        engine_gpus = max(span, math.ceil(c.gpus_per_engine))
        if cfg.rollout.engine == "sglang" and c.gpus_per_engine != span:
            raise PlanError(f"a server with sglang.tp_size={span} needs cluster.gpus_per_engine={span} "
                            f"(it is {c.gpus_per_engine:g})")
        if engine_gpus > hw.gpus_per_node:
            raise PlanError(f"an engine of {engine_gpus} GPUs does not fit one node of {hw.gpus_per_node} (a Ray "
                            "bundle lives on one node); lower sglang.tp_size / cluster.gpus_per_engine")
        need = trainer_gpus + engines * engine_gpus
        gpus = [[] for _ in range(need)]
        for r in range(world):
            gpus[(r // per_rank)].append(f"trainer rank {r}")
        for i in range(engines):
            start = trainer_gpus + i * engine_gpus
            for g in range(start, start + engine_gpus):
                gpus[g].append(f"engine {i}" + (f" (TP rank {g - start}/{engine_gpus})" if engine_gpus > 1 else ""))
        # PACK fills node by node; an engine's bundle may not straddle a node boundary.
        for i in range(engines):
            start = trainer_gpus + i * engine_gpus
            if start // hw.gpus_per_node != (start + engine_gpus - 1) // hw.gpus_per_node:
                notes.append(f"engine {i} would straddle nodes at GPU {start}; Ray moves its bundle to the next "
                             "node, so leave whole nodes to the engines (train.world_size a multiple of "
                             f"{hw.gpus_per_node})")
                break
    if need > hw.gpus:
        raise PlanError(f"the layout needs {need} GPUs but the hardware has {hw.nodes} x {hw.gpus_per_node} = "
                        f"{hw.gpus}; use --nodes {math.ceil(need / hw.gpus_per_node)} (cluster.nodes) or lower "
                        "train.world_size / cluster.num_engines")
    return gpus, notes


def sharding(cfg: Config) -> Sharding:
    world = cfg.train.world_size
    if cfg.train.backend != "megatron":
        return Sharding("fsdp2", world)
    m = cfg.megatron
    return Sharding("megatron", world, tp=m.tensor_parallel, pp=m.pipeline_parallel, ep=m.expert_parallel,
                    etp=m.expert_tensor_parallel, cp=m.context_parallel)


def build_plan(cfg: Config, hw: Hardware) -> Plan:
    gpus, notes = place(cfg, hw)
    shape = model_shape(architecture(cfg))
    train = train_memory(shape, sharding(cfg), cfg.train.micro_batch_tokens)
    usable = (hw.gpu_memory_gib - RESERVED_GIB) * GIB
    engines, span = engine_layout(cfg) if cfg.cluster.mode == "ray" else (1, 1)
    if cfg.rollout.engine == "sglang":
        fraction = cfg.sglang.mem_fraction_static or SGLANG_DEFAULT_FRACTION
        engine = engine_memory(shape, span, fraction * hw.gpu_memory_gib * GIB)
    else:  # the embedded engine: its own weights and the KV of its whole batch at full length
        need_kv = cfg.rollout.max_batch_size * cfg.env.max_total_tokens * shape.kv_bytes_per_token()
        weight_bytes = 4 if cfg.model.dtype == "float32" else 2
        engine = engine_memory(shape, 1, weight_bytes * shape.total_params + need_kv)
    if engine.kv_cache <= 0:
        raise PlanError(f"the engine's weights ({engine.weights / GIB:.1f} GiB per GPU) exceed its memory "
                        f"({engine.budget / GIB:.1f} GiB); raise sglang.tp_size or sglang.mem_fraction_static")
    if engine.kv_tokens < cfg.env.max_total_tokens:
        raise PlanError(f"the engine's KV cache holds {engine.kv_tokens} tokens, less than one trajectory "
                        f"(env.max_total_tokens={cfg.env.max_total_tokens}); raise sglang.mem_fraction_static "
                        "or sglang.tp_size")
    per_engine = math.ceil(cfg.rollout.concurrency / max(1, engines))
    if engine.kv_tokens < per_engine * cfg.env.max_total_tokens:
        notes.append(f"each engine's KV cache holds {engine.kv_tokens} tokens: "
                     f"{engine.kv_tokens // cfg.env.max_total_tokens} of its {per_engine} concurrent trajectories "
                     "at full length (the rest queue)")
    # What the recipe runs with: checkpointing only when it asks; logits in chunks only on FSDP2 (Megatron's
    # head computes a whole [T, V/TP] fp32 tensor per micro-batch).
    checkpointing = cfg.train.activation_checkpointing
    chunked = cfg.train.backend == "fsdp2" and cfg.train.logits_chunk_tokens > 0
    trainer_total = train.total(checkpointing=checkpointing, chunked_logits=chunked)
    offload = cfg.cluster.colocate and cfg.cluster.mode == "ray" and cfg.train.offload is not False
    if cfg.cluster.mode == "ray" and not cfg.cluster.colocate:
        peak = max(trainer_total, engine.budget)  # separate GPUs: the busier kind
    elif offload:
        peak = max(trainer_total, engine.budget)  # one GPU, the two phases in turn
    else:
        peak = trainer_total + engine.budget  # one GPU holding both all the time
    if peak > usable:
        if not checkpointing and train.total(checkpointing=True, chunked_logits=chunked) <= usable:
            fix = "set train.activation_checkpointing=true"
        elif train.weights + train.optimizer > usable / 2:
            fix = "raise cluster.nodes / train.world_size or the parallel sizes (megatron.*)"
        else:
            fix = "lower train.micro_batch_tokens"
        raise PlanError(f"a GPU needs {peak / GIB:.1f} GiB of {hw.gpu_memory_gib:g} ({RESERVED_GIB:g} kept for "
                        f"CUDA); {fix}")
    if checkpointing and train.total(checkpointing=False, chunked_logits=chunked) > usable:
        notes.append("fits only with activation checkpointing (the activations of every layer would not)")
    rows = [("trainer weights", train.weights), ("trainer gradients", train.gradients),
            ("optimizer (fp32 master + Adam)", train.optimizer),
            ("activations, checkpointed" if checkpointing else "activations (no checkpointing)",
             train.activations_checkpointed if checkpointing else train.activations),
            ("logits, in chunks" if chunked else "logits, unchunked fp32", 0.0 if chunked else train.logits),
            ("engine weights", engine.weights), ("engine KV cache", engine.kv_cache)]
    if offload:
        notes.append("colocated with offload: the trainer's state goes to host memory while engines generate, and "
                     "the engines release theirs while the trainer trains; the peak is the larger phase")
    notes.append(f"trainer rank holds {train.params_on_rank / 1e9:.2f}B of {shape.total_params / 1e9:.2f}B "
                 f"parameters ({shape.active_params / 1e9:.2f}B active); engine KV cache: {engine.kv_tokens} tokens")
    return Plan(hw, gpus, [(k, v / GIB) for k, v in rows], peak / GIB, notes)


def format_plan(cfg: Config, plan: Plan) -> str:
    hw = plan.hardware
    lines = [f"{cfg.train.backend} trainer x {cfg.train.world_size}, {cfg.rollout.engine} engines, "
             f"cluster.mode={cfg.cluster.mode}" + (", colocated" if cfg.cluster.colocate else "")
             + f" on {hw.nodes} node(s) x {hw.gpus_per_node} GPU(s) of {hw.gpu_memory_gib:g} GiB", "placement:"]
    for g, actors in enumerate(plan.gpus):
        lines.append(f"  node {g // hw.gpus_per_node} gpu {g % hw.gpus_per_node}: " + ", ".join(actors or ["idle"]))
    lines.append("memory per GPU (GiB, the busiest one):")
    lines += [f"  {k:<32} {v:9.2f}" for k, v in plan.memory]
    lines.append(f"  {'peak':<32} {plan.peak_gib:9.2f} of {hw.gpu_memory_gib:g}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_text(cfg: Config, nodes: int | None = None, gpus_per_node: int | None = None,
              gpu_memory_gib: float | None = None) -> str:
    """The ``miles_agent.planners`` entry point: the plan as text, or a PlanError."""
    c = cfg.cluster
    hw = Hardware(c.nodes if nodes is None else nodes, c.gpus_per_node if gpus_per_node is None else gpus_per_node,
                  c.gpu_memory_gib if gpu_memory_gib is None else gpu_memory_gib)
    if hw.nodes < 1 or hw.gpus_per_node < 1 or hw.gpu_memory_gib <= RESERVED_GIB:
        raise PlanError(f"hardware {hw.nodes} x {hw.gpus_per_node} GPUs of {hw.gpu_memory_gib:g} GiB is not a "
                        "machine; pass --nodes, --gpus-per-node and --gpu-memory as positive numbers")
    if not cfg.model.device.startswith("cuda"):
        return (f"model.device={cfg.model.device}: everything runs in this process on the CPU; nothing to place "
                "(a GPU recipe sets model.device=cuda)")
    return format_plan(cfg, build_plan(cfg, hw))
