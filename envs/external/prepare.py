"""Create every adapter's venv ahead of use: ``python -m miles_agent.envs.external.prepare [names...]``.

CI starts this in the background before the test suite, so the adapter tests find their venvs ready
(or wait on the creation lock) instead of each paying pip's minutes in turn.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from miles_agent.envs.external.adapters import HarborEnv, HudEnv, OpenEnvEnv, VerifiersEnv
from miles_agent.envs.external.nemo_gym import NEMO_GYM_VENV

ALL = {cls.name: cls().venv for cls in (OpenEnvEnv, VerifiersEnv, HarborEnv, HudEnv)} | {"nemo-gym": NEMO_GYM_VENV}


def prepare(name: str) -> str:
    start = time.perf_counter()
    try:
        path = ALL[name].ensure()
    except Exception as e:  # noqa: BLE001 - report each adapter, keep preparing the others
        return f"{name}: FAILED {type(e).__name__}: {e}"
    return f"{name}: {path} ({time.perf_counter() - start:.0f}s)"


def main() -> None:
    names = sys.argv[1:] or list(ALL)
    unknown = [n for n in names if n not in ALL]
    if unknown:
        sys.exit(f"unknown adapter(s) {unknown}; choose from {sorted(ALL)}")
    with ThreadPoolExecutor(len(names)) as pool:
        for line in pool.map(prepare, names):
            print(line, flush=True)


if __name__ == "__main__":
    main()
