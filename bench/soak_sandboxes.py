"""Soak: N sandboxed episodes at once, over and over for a duration, then count what they left behind.

Each episode goes through `EpisodeRunner` (sandbox start -> env session -> a few agent commands,
one of which leaves a background process running -> the verifier's command -> session close ->
sandbox stop), the path a training run takes. Every ``--sample-s`` seconds the process's RSS, open
file descriptors and live child processes are printed; at the end:

* leaked processes: our descendants still alive (zombies included), and any process carrying the
  episodes' marker argument (a background ``sleep`` that escaped its sandbox would be reparented away
  from us, so it is looked for by its marker);
* leaked file descriptors: /proc/self/fd now minus before;
* leaked mounts: /proc/self/mountinfo lines now minus before (a sandbox's tmpfs lives in its holder's
  private namespace and must vanish with it; none may appear on the host);
* leaked temp folders: entries left in this run's private TMPDIR;

all against a baseline taken after a short warm-up (what a process builds once and keeps, e.g. the
sandboxes' staged /etc, removed at exit, is not a per-episode leak);
* memory: RSS over time; "flat" when the last quarter's mean is within --rss-slack of the first's.

    python bench/soak_sandboxes.py                              # 256 at once for 10 minutes (issue #23)
    python bench/soak_sandboxes.py --concurrency 32 --minutes 1 # a short check

Exit status 0 when nothing leaked and memory stayed flat, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MARKER = "1000.2323"  # the background sleep's argument: unique enough to find an escaped process by


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def marked() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if MARKER.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def mounts(under: str) -> int:
    """Host mounts that are ours: under the private TMPDIR, or a sandbox's tmpfs (the shared machine's
    other mounts come and go)."""
    return sum(under in line or "miles-sandbox" in line or "miles-verifier" in line
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def build_runner(timeout_s: float):  # noqa: ANN201
    from miles_agent.environment import Environment, EnvSession, Harness, Reward, Task
    from miles_agent.rollout.episodes import EpisodeRunner
    from miles_agent.sandbox import SandboxLimits, SandboxSpec
    from miles_agent.sandboxes.local import LocalSandbox
    from miles_agent.types import Trajectory

    class Session(EnvSession):
        def __init__(self, sandbox) -> None:  # noqa: ANN001
            self.sandbox = sandbox

        async def call_tool(self, name, arguments):  # noqa: ANN001, ANN201
            return (await self.sandbox.exec(arguments["command"])).stdout

        async def score(self, messages):  # noqa: ANN001, ANN201
            r = await self.sandbox.exec("test \"$(cat /workspace/answer)\" = 42 && echo ok")
            return Reward(1.0 if r.stdout.strip() == "ok" else 0.0)

    class SoakEnv(Environment):
        name = "soak"
        needs_sandbox = True

        def tasks(self, split="train"):  # noqa: ANN001, ANN201
            return [Task(id="soak", messages=({"role": "user", "content": "write 42"},))]

        def sandbox_spec(self, task):  # noqa: ANN001, ANN201
            return SandboxSpec(limits=SandboxLimits(wall_time_s=timeout_s))

        async def open(self, task, sandbox=None):  # noqa: ANN001, ANN201
            return Session(sandbox)

    class Agent(Harness):
        name = "soak-agent"
        commands = ("echo 42 > /workspace/answer", f"(sleep {MARKER} &) ; echo started",
                    "ls /workspace | wc -l", "head -c 65536 /dev/zero | wc -c")

        async def run(self, task, session, policy):  # noqa: ANN001, ANN201
            for c in self.commands:
                await session.call_tool("bash", {"command": c})
            t = Trajectory(prompt_ids=[1], task_id=task.id)
            t.append_model([2], [-0.1], weight_version=0, turn=0)
            t.reward = (await session.score([])).value
            return [t]

    return EpisodeRunner(SoakEnv(), Agent(), make_sandbox=LocalSandbox)


async def soak(concurrency: int, seconds: float, sample_s: float) -> dict:
    runner = build_runner(timeout_s=30.0)
    task = runner.env.tasks()[0]
    done, rewards, samples = 0, 0.0, []
    end = time.monotonic() + seconds
    start = time.monotonic()

    async def worker(i: int) -> None:
        nonlocal done, rewards
        while time.monotonic() < end:
            (t,) = await runner.run(task, policy=None, group_id=f"w{i}")
            done += 1
            rewards += float(t.reward or 0.0)

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic() - start, rss_mib(), fds(), len(descendants(os.getpid())), done))
            print(f"t={samples[-1][0]:6.1f}s  rss {samples[-1][1]:7.1f} MiB  fds {samples[-1][2]:5d}  "
                  f"children {samples[-1][3]:5d}  episodes {done}", flush=True)
            await asyncio.sleep(max(min(sample_s, end - time.monotonic()), 0))

    await asyncio.gather(sampler(), *(worker(i) for i in range(concurrency)))
    return {"episodes": done, "reward_mean": rewards / max(done, 1), "failed": runner.stats.failed,
            "aborted": runner.stats.aborted, "errors": runner.stats.errors[-3:], "samples": samples,
            "seconds": time.monotonic() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    ap.add_argument("--rss-slack", type=float, default=0.10, help="allowed RSS growth, first to last quarter")
    args = ap.parse_args()

    private_tmp = tempfile.mkdtemp(prefix="miles-soak-")
    os.chmod(private_tmp, 0o755)  # the sandbox's unprivileged uid must be able to enter it
    os.environ["TMPDIR"] = private_tmp  # the sandboxes' folders go here, so leftovers are ours alone
    tempfile.tempdir = None
    # Warm-up: what a process makes once and keeps (the staged /etc, removed at exit; the spawn thread)
    # exists before the baseline, so only what grows with episodes counts as a leak.
    asyncio.run(soak(min(args.concurrency, 8), 2.0, 60.0))
    base_fds, base_mounts, base_children = fds(), mounts(private_tmp), set(descendants(os.getpid()))
    base_tmp = set(os.listdir(private_tmp))
    result = asyncio.run(soak(args.concurrency, args.minutes * 60, args.sample_s))
    time.sleep(1.0)  # a killed process tree's last exits
    leaked_procs = sorted(set(descendants(os.getpid())) - base_children) + marked()
    leaked_fds, leaked_mounts = fds() - base_fds, mounts(private_tmp) - base_mounts
    leftovers = sorted(set(os.listdir(private_tmp)) - base_tmp)
    rss = [s[1] for s in result["samples"]]
    q = max(len(rss) // 4, 1)
    first, last = sum(rss[:q]) / q, sum(rss[-q:]) / q
    flat = last <= first * (1 + args.rss_slack)
    print(f"\n{result['episodes']} episodes in {result['seconds']:.0f}s at concurrency {args.concurrency} "
          f"({result['episodes'] / result['seconds']:.1f}/s), reward mean {result['reward_mean']:.3f}, "
          f"{result['failed']} failed, {result['aborted']} aborted {result['errors'] or ''}")
    print(f"leaked: processes {len(leaked_procs)} {leaked_procs[:10]}, file descriptors {leaked_fds}, "
          f"mounts {leaked_mounts}, temp folders {len(leftovers)} {leftovers[:5]}")
    print(f"memory: RSS first quarter {first:.1f} MiB -> last quarter {last:.1f} MiB "
          f"({'flat' if flat else 'GROWING'}, slack {args.rss_slack:.0%})")
    shutil.rmtree(private_tmp, ignore_errors=True)
    ok = not leaked_procs and leaked_fds <= 0 and leaked_mounts <= 0 and not leftovers and flat
    ok = ok and result["failed"] == 0 and result["aborted"] == 0 and result["episodes"] > 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
