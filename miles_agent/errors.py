"""User-facing errors: the CLI prints their message as one line and exits non-zero, with no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, recipe, plug-in name, path, hardware request). The message names cause and fix."""

    exit_code = 2


class MissingDependency(UserError):
    """An optional extra is needed but not installed."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the Python package '{package}', which is not installed; "
            f"install it with: pip install 'miles-agent[{extra}]'")


def require(module: str, extra: str, purpose: str):  # noqa: ANN201 - returns the module
    """Import an optional dependency lazily, or raise a MissingDependency naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(module.split(".")[0], extra, purpose) from e


class InfraError(RuntimeError):
    """Infrastructure failed under an episode (engine crash, sandbox, environment server): the episode
    is retried and counted, never scored 0."""


class RunAborted(RuntimeError):
    """The run cannot go on (a trainer rank died, engines keep crashing). Never retried as an episode;
    the message says what died and how to continue (usually --resume from the last checkpoint)."""
