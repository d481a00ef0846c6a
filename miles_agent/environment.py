"""The environment and harness contracts: what an agent task is, and the loop that plays it.

An `Environment` lists tasks, opens an `EnvSession` per episode (its tools, and a verifier that
turns the final state into a reward), and is registered as a plug-in (entry-point group
``miles_agent.envs``). A `Harness` runs the loop between a `Policy` and a session and returns
trajectories (several when the agent's history stops being append-only). Torch-free on purpose:
environment workers may run on CPU-only nodes under another Python.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from miles_agent.engine import Policy
from miles_agent.sandbox import Sandbox, SandboxSpec
from miles_agent.types import Trajectory


@dataclass(frozen=True)
class Task:
    """One task: the opening messages and whatever the verifier needs (kept out of the prompt)."""

    id: str
    messages: tuple[dict[str, Any], ...]
    info: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Reward:
    value: float
    parts: dict[str, float] = field(default_factory=dict)


class ToolError(Exception):
    """A tool call the environment rejects (unknown tool, bad arguments). Shown to the model, not raised further."""


class EnvSession(ABC):
    """One episode's view of the environment. The episode owns it until `score` has returned."""

    #: OpenAI function-tool schemas offered to the model ({"type": "function", "function": {...}}).
    tools: list[dict[str, Any]] = []

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        raise ToolError(f"this environment has no tools (called {name!r})")

    @abstractmethod
    async def score(self, messages: list[dict[str, Any]]) -> Reward:
        """Verify the final state of the episode (the whole conversation, and the sandbox if any)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most sessions hold nothing
        """Release what the session holds. Called exactly once, after scoring or on failure."""


class Environment(ABC):
    """A task set and its verifier. Subclasses are plug-ins: give them a name and a one-line description."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    needs_sandbox: ClassVar[bool] = False
    #: ``env.*`` config keys the constructor takes as keywords of the same name (terminal-bench: "sandbox");
    #: declared rather than read off the signature, and checked by the build step before any model loads.
    env_keys: ClassVar[tuple[str, ...]] = ()
    #: The type of ``env.options`` (a dataclass whose fields are constructor keywords), checked before any
    #: model loads; None: the options reach the constructor unchecked.
    options_type: ClassVar[type | None] = None
    #: The rewards the verifier can give, [low, high]; one outside is counted and refused or clipped
    #: (``env.reward_out_of_range``) before it reaches the advantages. (-inf, inf): unbounded.
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    @abstractmethod
    def tasks(self, split: str = "train") -> list[Task]: ...

    def sandbox_spec(self, task: Task) -> SandboxSpec:
        """What the task's sandbox needs (image, files, limits). Only asked when ``needs_sandbox``."""
        return SandboxSpec()

    @abstractmethod
    async def open(self, task: Task, sandbox: Sandbox | None = None) -> EnvSession:
        """Start an episode. The caller started ``sandbox`` from `sandbox_spec` and stops it after
        `EnvSession.close`, so the verifier always runs before the sandbox goes away."""


@dataclass(frozen=True)
class HarnessLimits:
    max_turns: int = 8
    max_total_tokens: int = 2048  # prompt + everything appended; the episode is truncated past it
    max_new_tokens_per_turn: int = 256
    max_observation_tokens: int = 512  # longer tool output is cut and the cut is marked


class Harness(ABC):
    """An agent loop. Returns one trajectory per branch of the conversation (usually one)."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    #: ``env.*`` config keys the constructor takes as keywords after (tokenizer, limits, sampling),
    #: e.g. the black-box harness's ("agent", "agent_timeout_s"); checked like `Environment.env_keys`.
    env_keys: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    async def run(self, task: Task, session: EnvSession, policy: Policy) -> list[Trajectory]: ...


def split_tasks(env: Environment, split: str, key: str | None = "--split") -> list[Task]:
    """``env.tasks(split)``, or a UserError naming the split: one the env does not have, or one with no tasks."""
    from miles_agent.errors import UserError

    try:
        tasks = list(env.tasks(split))
    except (ValueError, KeyError) as e:
        raise UserError(f"{key or 'split'}={split!r}: environment {env.name!r} has no such split ({e})") from None
    if not tasks and not getattr(env, "excluded", None):  # (all refused: eval reports each one's reason)
        raise UserError(f"environment {env.name!r} has no tasks in its {split!r} split; check where it reads them "
                        f"(--tasks, env.options){f' or set {key} to a split that has some' if key else ''}")
    return tasks
