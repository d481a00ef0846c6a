"""Typed run configuration: a recipe file plus ``section.key=value`` overrides, one source of truth.

Each section is a frozen dataclass owned by the part that reads it; a plug-in declares its own (``sglang``,
``megatron``) through the ``miles_agent.sections`` entry-point group. Nobody reads a config through
``getattr(args, x, default)``: a key that does not exist is an error at load time, with the closest
valid key suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from miles_agent.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
log = logging.getLogger(__name__)

# Values renamed since release, still read: "local" named the engine, the sandbox and the cluster mode.
RENAMED = {"rollout.engine": {"local": "embedded"}, "cluster.mode": {"local": "inprocess"}}


@dataclass(frozen=True)
class ModelConfig:
    # A built-in tiny architecture ("tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-vl": docs/vlm.md) or "hf" with hf_checkpoint set.
    arch: str = "tiny-qwen3"
    hf_checkpoint: str | None = None  # any HF-format folder (config.json, safetensors, tokenizer)
    warm_start: str | None = None  # "builtin" = the env's own SFT warm start (made once, cached)
    dtype: str = "float32"
    device: str = "cpu"
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # to every apply_chat_template, e.g. enable_thinking: false
    family: str = "auto"  # chat/tool-call format (docs/recipes.md); auto = from config.json's model_type


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "embedded"  # a miles_agent.engines plug-in: embedded (in-process torch) | sglang
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_batch_size: int = 128  # concurrent sequences the embedded engine decodes together
    concurrency: int = 128  # episodes in flight at once
    # Scheduling (miles_agent/scheduling.py): how rollout overlaps training, and what a weight update does.
    mode: str = "sync"  # sync | one_step_off (next batch generated while training) | async (continuous)
    max_staleness: int = 1  # a trained sample's oldest span is at most this many weight versions old
    stale: str = "recycle"  # a sample past max_staleness: recycle (re-run with newer weights) | drop
    max_recycles: int = 3  # recycle: re-runs of one stale sample before it is dropped (stale_gave_up)
    partial_rollout: str = "keep"  # episodes in flight at an async weight update: keep | abort | retract
    group_filter: str = ""  # module:fn(group) -> bool, on DAPO's round budget (docs/extensions.md)
    buffer_filter: str = ""  # module:fn(trajectories) -> list[Trajectory], the batch before training
    function: str = ""  # module:async fn(ctx) -> list[Trajectory], replaces episode generation for a step
    # The embedded engine's weights, quantized at each sync (docs/precision.md): auto | bf16 | fp8 | mxfp8 | int4
    weight_format: str = "auto"
    prefix_cache_mb: int = 1024  # embedded engine: KV kept to reuse prompt prefixes (turns, group samples); 0 = off


@dataclass(frozen=True)
class TrainConfig:
    backend: str = "fsdp2"
    lr: float = 1e-4
    lr_schedule: str = "constant"  # constant | cosine | linear (after warm-up)
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0  # optimizer steps until the decay reaches min_lr_ratio * lr
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192  # micro-batches are packed by token count up to this
    mini_batches: int = 1  # optimizer steps per rollout batch, each on a 1/n share of its sequences
    ppo_epochs: int = 1  # passes over the rollout batch; old logprobs are computed once before the first
    world_size: int = 1  # FSDP2 ranks; 1 runs in-process
    offload: bool | str = "auto"  # state to host while engines generate; auto = on with cluster.colocate (Ray)
    # Precision and memory (docs/precision.md): fp32 master weights and optimizer state under a bf16
    # model.dtype (compute in model.dtype); "bfloat16" = plain bf16 AdamW (most small updates round away).
    master_dtype: str = "float32"
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (fsdp2)
    # fsdp2: a micro-batch's sequences in one row, no pad tokens computed; auto = on unless algo.true_on_policy
    # (which runs the engine's kernels on one sequence per row); other backends: off (true is refused)
    pack_sequences: bool | str = "auto"
    logits_chunk_tokens: int = 1024  # LM head + log-softmax per chunk of this many tokens; 0 = all at once
    qat: str = "none"  # none | int4: group-wise int4 fake quantization (STE) in the forward (fsdp2)


@dataclass(frozen=True)
class AlgoConfig:
    advantage: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gae
    normalize_std: bool = True  # False = Dr.GRPO
    gamma: float = 1.0  # per-token discount (reinforce_pp*, gae)
    gae_lambda: float = 0.95
    loss: str = "ppo_clip"  # ppo_clip | gspo | sft
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # clip-higher; None = clip_eps
    dual_clip_c: float | None = None  # dual clip on negative advantages (> 1); None = off
    kl_coef: float = 0.0  # KL to the reference model as a loss term
    kl_reward_coef: float = 0.0  # KL to the reference folded into per-token rewards (token-level estimators)
    kl_estimator: str = "k3"  # k1 | k2 | k3, for both KL uses
    entropy_coef: float = 0.0
    loss_agg: str = "token_mean"  # token_mean | seq_mean_token_sum | seq_mean_token_mean | group_mean_token_mean
    use_rollout_logprobs: bool = True  # rollout logprobs as the old policy (no extra forward)
    critic_lr: float = 1e-4  # the value model's learning rate (gae)
    value_clip: float = 0.2  # clipped value loss range around the old values; <= 0 = unclipped
    mismatch_correction: str = "none"  # none | tis | mis | icepop (rollout/training logprob mismatch)
    mismatch_level: str = "token"  # token | sequence | geometric (tis and mis)
    mismatch_low: float = 0.5  # trust range [low, high] of pi_train / pi_rollout
    mismatch_high: float = 2.0
    mismatch_veto: float = 0.0  # drop a sequence if any token's ratio is below this; 0 = off
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups, roll out more to refill the batch
    dynamic_sampling_max_rounds: int = 4  # rollout rounds per step at most (the first included)
    # Rollout/train consistency (trainers/routing_replay.py, miles_agent/true_on_policy.py):
    routing_replay: bool = False  # R3: MoE trainer forwards route by the engine's recorded expert ids
    true_on_policy: bool = False  # engine and trainer share batch-invariant kernels: bitwise-equal logprobs
    # On-policy distillation (miles_agent/teacher.py): off while distill_teacher is None.
    distill_teacher: str | None = None  # the teacher's HF folder, or "builtin" = the env's warm start
    distill_mode: str = "reward"  # reward: reverse KL in per-token advantages | loss: a loss term
    distill_coef: float = 1.0  # weight of the reverse-KL signal
    distill_task_coef: float = 1.0  # weight of the task reward's advantage beside it; 0 = pure distillation
    loss_mask_filter: str = ""  # module:fn(trajectory) -> bool | list[int], ANDed into the loss mask
    # Turn-level credit (docs/algorithms.md): turn rewards from reward_parts "turn_reward/<k>", discounted.
    turn_discount: float = 1.0  # per turn; 1.0 with no turn rewards = the plain per-sample estimator
    overlong: str = "keep"  # truncated trajectories (a length limit cut them): keep | mask | downweight
    overlong_weight: float = 0.5  # overlong=downweight: their advantages are multiplied by this


@dataclass(frozen=True)
class SFTConfig:
    """What an ``algo.loss: sft`` run trains on (miles_agent/sft.py)."""

    data: str = "demonstrator"  # "demonstrator" (the env's, on `split`) or a .jsonl of Trajectory.to_dict() lines
    split: str = "sft"  # the env's task split the demonstrator plays
    tool_rate: float = 1.0  # demonstrator data: how often it calls its tool (arith-tools: 1.0 = the oracle)
    batch_size: int = 32  # trajectories per optimizer step
    max_examples: int = 0  # use at most this many trajectories (the first ones); 0 = all


@dataclass(frozen=True)
class EnvConfig:
    name: str = "arith-tools"
    harness: str = ""  # "" = the environment's default harness
    tasks: str | None = None  # a folder of tasks, for environments that read one
    sandbox: str = "local"  # sandbox backend for environments that need one
    sandbox_options: dict[str, Any] = field(default_factory=dict)  # the backend's options (docs/sandboxes.md)
    options: dict[str, Any] = field(default_factory=dict)  # the environment's own options (its options_type)
    max_turns: int = 4
    max_total_tokens: int = 1024
    max_new_tokens_per_turn: int = 96
    max_observation_tokens: int = 256
    agent: str = ""  # black-box harness: the agent command, or module:function of an async agent
    agent_timeout_s: float = 600.0  # black-box harness: the agent's wall-clock limit per episode
    reward_out_of_range: str = "refuse"  # a reward outside the env's reward_range: refuse (not trained) | clip
    reward: str = ""  # module:fn(task, messages, env_reward) -> float | Reward, per episode (docs/extensions.md)
    group_reward: str = ""  # module:fn(task, responses, trajectories) -> list[float], per group
    reward_post: str = ""  # module:fn(rewards, trajectories) -> list[float], on the whole batch
    mix: str = ""  # several envs (envs/mix): "arith-tools:0.7,dataset:0.3"; options: env.options.<name>.<key>


@dataclass(frozen=True)
class RunConfig:
    steps: int = 20
    seed: int = 0
    run_dir: str = "runs/latest"
    checkpoint_every: int = 0  # 0 = only at the end
    eval_every: int = 0
    progress: bool = True
    sinks: str = ""  # extra metric sinks besides metrics.jsonl: "tensorboard", "wandb", or both comma-separated
    wandb_project: str = "miles-agent"
    dump_rollouts: int = 0  # write every N-th step's trajectories to RUN_DIR/rollouts/ (0 = never)
    log_samples: int = 2  # trajectories per step kept in RUN_DIR/samples.jsonl for `miles-agent report`
    hooks: str = ""  # module:obj[,module2:obj2] with on_run_start / after_rollout / ... (docs/extensions.md)


@dataclass(frozen=True)
class ClusterConfig:
    """Where the parts run: one process, or Ray actors in placement groups (runtime/)."""

    mode: str = "inprocess"  # a miles_agent.clusters plug-in: inprocess (this process) | ray (Ray actors)
    ray_address: str | None = None  # None = start Ray on this machine (loopback); "auto" / host:port = join
    num_engines: int = 1  # rollout engine actors (mode=ray)
    colocate: bool = False  # engines share the trainer ranks' bundles, releasing memory while they train
    gpus_per_engine: float = 0.0
    trainer_gpus: float = 0.0  # per trainer rank (train.world_size ranks)
    cpus_per_actor: float = 1.0
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 10.0  # an engine silent this long (or stuck with work) is restarted
    max_engine_restarts: int = 50  # over the whole run; past it the run stops with a clear error
    # The hardware the recipe is written for (`miles-agent plan` checks the layout and memory against it).
    nodes: int = 1
    gpus_per_node: int = 8
    gpu_memory_gib: float = 80.0


@dataclass(frozen=True)
class SyncConfig:
    # How weights reach the engines (transports/): auto | inprocess | shm | distributed | disk, and under
    # cluster.mode=ray object-store. auto = inprocess in one process, object-store with Ray engine actors.
    transport: str = "auto"
    bucket_mb: int = 64  # extra memory a sync needs is about one bucket on each side
    # object-store: engines on trainer rank 0's node take the bytes from shared memory that rank 0 keeps
    # (the model's size in /dev/shm) instead of a ray.put per push; false: ray.put always
    shared_memory: bool = True
    check: bool = False  # after every sync, compare per-tensor checksums of trainer and engines
    backend: str = "auto"  # distributed: gloo | nccl | auto (nccl on cuda, else gloo)
    master_address: str = "127.0.0.1"  # distributed: where the engines meet trainer rank 0
    master_port: int = 0  # distributed: 0 = a free port
    disk_dir: str = ""  # disk: "" = <run.run_dir>/weights
    disk_keep: int = 2  # disk: newest versions kept on disk
    strip_prefix: str = ""  # trainer-name prefix removed before sending (e.g. "_orig_mod.")
    add_prefix: str = ""  # prefix added to every engine name


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    # The plug-ins' own sections (entry-point group miles_agent.sections, e.g. sglang, megatron), read as
    # cfg.<name> like the core's; every installed section is present, with its defaults when not given.
    sections: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = {name: cls() for name, cls in section_types().items() if name not in self.sections}
        if missing:
            object.__setattr__(self, "sections", {**self.sections, **missing})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "sections":  # copy / pickle probe before __init__ ran
            raise AttributeError(name)
        try:
            return self.sections[name]
        except KeyError:
            raise AttributeError(f"config has no section {name!r}") from None

    def with_section(self, name: str, value: Any) -> Config:
        return dataclasses.replace(self, sections={**self.sections, name: value})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(d.pop("sections"))
        return d


@functools.lru_cache(maxsize=1)
def section_types() -> dict[str, type]:
    """Section name -> its dataclass, for every installed ``miles_agent.sections`` entry point."""
    from miles_agent import registry

    return {name: registry.load("sections", name) for name in registry.names("sections")}


# -- loading ---------------------------------------------------------------------------------------

def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise UserError(f"recipe file {p} does not exist; pass a YAML path or one of: "
                            f"{', '.join(available_recipes())}")
        return p
    p = RECIPES_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        raise UserError(f"unknown recipe {name_or_path!r}; choose one of: {', '.join(available_recipes())}, "
                        "or pass a path to a YAML file")
    return p


def load_config(recipe: str | None = None, overrides: list[str] | dict[str, Any] | None = None,
                extra: dict[str, Any] | None = None) -> Config:
    """Build the config: defaults, then the recipe file, then overrides (``section.key=value`` strings
    or a dict of already-typed values), then ``extra`` (values from dedicated CLI flags)."""
    data: dict[str, Any] = {}
    if recipe:
        path = resolve_recipe(recipe)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise UserError(f"recipe {path} is not valid YAML{where}; fix the file's syntax") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError(f"recipe {path} must be a mapping of sections (model:, rollout:, ...), "
                            f"not a {type(loaded).__name__}")
        data = loaded or {}
    items = list(overrides.items()) if isinstance(overrides, dict) else [_split_override(o) for o in overrides or []]
    for key, value in items + list((extra or {}).items()):
        section, _, name = key.partition(".")
        if not name:
            raise UserError(f"override {key!r} must be section.key=value, e.g. train.lr=1e-5")
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise UserError(f"recipe section {section!r} must be a mapping")
        *parents, leaf = name.split(".")  # env.options.args.k=v: into the nested mapping env.options.args
        where = data[section]
        for i, part in enumerate(parents):
            where = where.setdefault(part, {})
            if not isinstance(where, dict):
                raise UserError(f"override {key!r}: {section}.{'.'.join(parents[:i + 1])} is not a mapping")
        where[leaf] = value
    sections = section_types()
    given = {k: typed(sections[k], data.pop(k), k) for k in list(data) if k in sections}
    return dataclasses.replace(typed(Config, data, "", extra=list(sections)), sections=given)


def _split_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise UserError(f"override {text!r} must look like section.key=value, e.g. run.steps=10")
    return key.strip(), yaml.safe_load(value) if value.strip() else ""


def closest(key: str, names: Sequence[str]) -> str | None:
    """The name in ``names`` that ``key`` was most likely meant to be, for a "did you mean" hint."""
    close = difflib.get_close_matches(key, names, n=1)
    return close[0] if close else None


def typed(cls: type, data: Any, where: str, extra: list[str] | None = None) -> Any:
    """The dataclass ``cls`` from a mapping, each value coerced to its field's type (config sections and
    plug-in options alike); ``where``: the key the mapping sits under, named in errors; ``extra``: the
    names also valid here (plug-in sections, at the root)."""
    if not isinstance(data, dict):
        raise UserError(f"config section {where or 'root'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "sections"] + (extra or [])
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else key
        if key not in names:
            close = closest(key, names)
            hint = f"; did you mean {(where + '.' if where else '') + close!r}?" if close else \
                f"; valid keys: {', '.join(names)}"
            raise UserError(f"unknown config key {full!r}{hint}")
        kwargs[key] = _renamed(full, _coerce(hints[key], value, full))
    return cls(**kwargs)


def _renamed(key: str, value: Any) -> Any:
    new = RENAMED.get(key, {}).get(value) if isinstance(value, str) else None
    if new is None:
        return value
    log.warning("%s=%s is now called %s=%s; reading it as %s (update the recipe or override)",
                key, value, key, new, new)
    return new


def _coerce(tp: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp):  # an instance already built (a dict of typed overrides) is kept
        return value if isinstance(value, tp) else typed(tp, value, where)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, where)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0])
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[str, ...]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"config key {where!r} must be a list, got {value!r}")
        return tuple(_coerce(args[0], v, where) for v in value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"config key {where!r} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, where) for a, v in zip(args, value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key {where!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"config key {where!r} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads 1e-5 as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"config key {where!r} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"config key {where!r} must be a string, got {value!r}")
    return value
