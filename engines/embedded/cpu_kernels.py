"""The embedded engine's CPU kernels (cpu_kernels.cpp): a Qwen3 layer's attention block and dense MLP block as
one call each, and the sampler as one call per step, compiled on first use with torch's extension builder and
cached, as DeepSpeed and SGLang's CPU backend build their CPU ops.

Why: a decode step of a small model on a CPU is ~300 tiny torch ops, each 3-10 us of dispatch; the kernels
run everything between the matmuls as loops over each token's row (the matmuls stay ATen's). They need a C++
compiler and ninja (the ``ninja`` package is a dependency); the first build takes ~30-60 s and lands in
torch's extension cache (``TORCH_EXTENSIONS_DIR``), so later processes load it in well under a second.

`load()` returns the module, or None when the kernels are off or cannot be built -- the engine then runs
its torch forward (`fused.py`), which is also the reference the kernels are tested against. Off:
``MILES_AGENT_CPU_KERNELS=0``. ``python -m miles_agent.engines.embedded.cpu_kernels`` builds them ahead of
time (.ci/run does) and says where, or why not.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_VERSION = 2  # bump when the source's interface changes
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module" once loaded, or "error": why not


def enabled_by_env() -> bool:
    return os.environ.get("MILES_AGENT_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def load() -> Any | None:
    """The compiled kernels, building them once per machine; None (with `unavailable_reason`) if they can't be."""
    if not enabled_by_env():
        return None
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        try:
            _state["module"] = _build()
        except Exception as e:  # noqa: BLE001 - any build failure means: use the torch forward
            _state["error"] = _why(e)
            logger.warning("the embedded engine's CPU kernels could not be built (%s); it runs its torch forward "
                           "instead, slower on a CPU. Install a C++ compiler (g++) and ninja, or set "
                           "MILES_AGENT_CPU_KERNELS=0 to silence this.", _state["error"])
        return _state.get("module")


def _why(error: Exception) -> str:
    """The compiler's first error line when there is one (the builder's message ends in ninja's summary)."""
    lines = str(error).strip().splitlines()
    first = next((line for line in lines if "error:" in line), lines[-1] if lines else "")
    return f"{type(error).__name__}: {first.strip()}"


def unavailable_reason() -> str | None:
    """Why `load` returned None, or None if it did not (or was not called)."""
    if not enabled_by_env():
        return "MILES_AGENT_CPU_KERNELS=0"
    return _state.get("error")


def toolchain_missing() -> str | None:
    """What is missing to build the kernels here (a C++ compiler, ninja), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _name() -> str:
    """The module's name, per instruction set: the build uses -march=native, and torch's cache may sit on a
    home directory that machines with other CPUs share (a cluster's NFS home); each gets its own build."""
    import hashlib
    import platform

    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags += platform.processor()
    return f"miles_agent_cpu_kernels_v{_VERSION}_{hashlib.sha1(flags.encode()).hexdigest()[:10]}"


def _build() -> Any:
    missing = toolchain_missing()
    if missing:
        raise RuntimeError(missing)
    from torch.utils import cpp_extension

    logger.info("loading the embedded engine's CPU kernels (the first time on a machine compiles them: ~40 s)")
    # -march=native: the build is per machine (torch's cache lives on it), so use its vector units.
    return cpp_extension.load(name=_name(), sources=[str(_SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                              verbose=False)


def main() -> None:
    import time

    t0 = time.perf_counter()
    module = load()
    if module is None:
        raise SystemExit(f"the embedded engine's CPU kernels are not available: {unavailable_reason()}")
    print(f"the embedded engine's CPU kernels are built ({module.__file__}, {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
