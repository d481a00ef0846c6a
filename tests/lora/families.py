"""arith-tools in two task families for the multi-LoRA test: ``plus-N`` (+ and -) and ``times-N`` (*)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from miles_agent.envs import arith_tools
from miles_agent.envs.arith_tools import ArithToolsEnv

WARM_START = str(Path(arith_tools.__file__).parent / "warmstart" / "tiny-qwen3")


class TwoFamilies(ArithToolsEnv):
    def tasks(self, split: str = "train"):  # noqa: ANN201
        return [dataclasses.replace(t, id=f"{'times' if '*' in t.info['expr'] else 'plus'}-{t.id}")
                for t in super().tasks(split)]
