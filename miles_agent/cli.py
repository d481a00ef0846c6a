"""``miles-agent``: train, eval, list plug-ins, build warm starts.

Bad input ends with one line naming the cause and the fix, exit code 2, and no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from miles_agent.errors import RunAborted, UserError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", required=True, help="environment name (see `miles-agent envs list`) or module:attr")
    p.add_argument("--recipe", default="tiny-cpu", help="recipe name in recipes/ or a YAML path (default: tiny-cpu)")
    p.add_argument("--hf-checkpoint", help="start from this HF-format folder (config.json + safetensors)")
    p.add_argument("--tasks", help="a folder of tasks, for environments that read one (e.g. Harbor tasks)")
    p.add_argument("--seed", type=int)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.lr=1e-5")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles-agent", description="Agentic RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a policy on an environment (RL, SFT or distillation, by recipe)")
    _common(t)
    t.add_argument("--run-dir", help="where metrics.jsonl, checkpoints and the final model go")
    t.add_argument("--steps", type=int)
    t.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace the run already in --run-dir (else refused)")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--ray-address", help="run engines and trainer ranks as actors on this Ray cluster "
                   "('auto' or host:port; sets cluster.mode=ray)")

    e = sub.add_parser("eval", help="score a policy on an environment's tasks")
    _common(e)
    e.add_argument("--policy", default="model", help="'model' (the checkpoint or warm start) or 'oracle'")
    e.add_argument("--split", default="eval")
    e.add_argument("--limit", type=int, help="evaluate at most this many tasks")
    e.add_argument("--job-dir", help="where the job folder goes (default RUN_DIR/eval/<time>)")

    pl = sub.add_parser("plan", help="a recipe's placement (actor -> GPU) and per-GPU memory on its hardware")
    pl.add_argument("--recipe", required=True, help="recipe name in recipes/ or a YAML path")
    pl.add_argument("--nodes", type=int, help="nodes (default: the recipe's cluster.nodes)")
    pl.add_argument("--gpus-per-node", type=int, help="default: the recipe's cluster.gpus_per_node")
    pl.add_argument("--gpu-memory", type=float, metavar="GiB", help="default: the recipe's cluster.gpu_memory_gib")
    pl.add_argument("overrides", nargs="*", metavar="section.key=value")

    from miles_agent.registry import KINDS

    for kind in KINDS:
        k = sub.add_parser(kind, help=f"list installed {kind} ({KINDS[kind]} plug-ins)")
        k.add_argument("action", choices=["list"])

    s = sub.add_parser("sandbox", help="run a command in a sandbox by hand (miles-agent sandbox exec -- CMD)",
                       epilog="exec exits with the command's exit code; 124 if it ran past --timeout; "
                              "141 if the output's reader closed the pipe early")
    s.add_argument("action", choices=["exec", "reap"], help="exec: run a command; reap: remove expired sandboxes")
    s.add_argument("--backend", default="local", help="sandbox backend (see `miles-agent sandboxes list`)")
    s.add_argument("--timeout", type=float, default=30.0, help="wall-time limit in seconds")
    s.add_argument("--unisolated", action="store_true", help="local backend only: run without bubblewrap")
    s.set_defaults(cmd=[])  # everything after `--` (split off in main, so options stay options)

    add_observability_commands(sub)

    w = sub.add_parser("warmstart", help="build (or rebuild) an environment's SFT warm start")
    w.add_argument("--env", required=True)
    w.add_argument("--arch", default="tiny-qwen3")
    w.add_argument("--out", help="output folder (default: the cache)")
    return parser


def _config(args: argparse.Namespace) -> Any:
    from miles_agent.config import load_config

    extra: dict[str, Any] = {"env.name": args.env}
    for flag, key in (("hf_checkpoint", "model.hf_checkpoint"), ("tasks", "env.tasks"), ("seed", "run.seed"),
                      ("run_dir", "run.run_dir"), ("steps", "run.steps")):
        value = getattr(args, flag, None)  # argparse namespaces are the one place flags are read by name
        if value is not None:
            extra[key] = value
    if getattr(args, "ray_address", None):
        extra.update({"cluster.mode": "ray", "cluster.ray_address": args.ray_address})
    from miles_agent.server_flags import with_server_args

    return with_server_args(load_config(args.recipe, list(args.overrides), extra),
                            getattr(args, "sglang_server_args", {}))


def cmd_train(args: argparse.Namespace) -> int:
    from miles_agent.build import check_choices
    from miles_agent.run_state import Interrupted, check_resume, check_run_dir

    cfg = _config(args)
    check_choices(cfg)  # bad input fails before --overwrite removes anything
    args.resume = check_run_dir(Path(cfg.run.run_dir), args.resume, args.overwrite)
    if args.resume and (done := check_resume(Path(cfg.run.run_dir), cfg)) >= cfg.run.steps:
        print(f"miles-agent: {cfg.run.run_dir} already ran {done} steps (run.steps={cfg.run.steps}): nothing to do; "
              "raise run.steps (or --steps) to train it further")
        return 0
    try:
        return _train(args, cfg)
    except Interrupted as e:
        print(f"miles-agent: {e}; resume with:\n  {resume_command(args)}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:  # a second signal: the step in progress is lost, earlier checkpoints are not
        saved = (Path(cfg.run.run_dir) / "checkpoints" / "latest").is_file()
        print("miles-agent: aborted mid-step; " + (f"resume from the last checkpoint with:\n  {resume_command(args)}"
              if saved else "no checkpoint was saved (run.checkpoint_every=N saves every N steps)"), file=sys.stderr)
        return 130


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: the same one, with --resume and without --overwrite."""
    argv = [a for a in args.argv if a != "--overwrite"]
    return "miles-agent " + shlex.join(argv if "--resume" in argv else [*argv[:1], "--resume", *argv[1:]])


def _train(args: argparse.Namespace, cfg: Any) -> int:
    from miles_agent.loop import train
    from miles_agent.progress import Progress, generated_tokens

    enabled = cfg.run.progress and not args.no_progress
    records = train(cfg, resume=args.resume,
                    progress=lambda run: Progress(cfg.run.steps, start=run.step, enabled=enabled,
                                                  generated_tokens=lambda: generated_tokens(run.engines),
                                                  concurrency=cfg.rollout.concurrency))
    if records:
        key, what = ("reward_mean", "reward") if "reward_mean" in records[0] else ("train/loss", "loss")
        first = [r[key] for r in records[:5]]
        last = [r[key] for r in records[-5:]]
        print(f"done: {what} first-5 mean {sum(first) / len(first):.3f} -> last-5 mean {sum(last) / len(last):.3f}; "
              f"metrics in {Path(cfg.run.run_dir) / 'metrics.jsonl'}, model in {Path(cfg.run.run_dir) / 'final'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from miles_agent.evaluate import evaluate

    cfg = _config(args)
    from miles_agent.evaluate import format_table

    report = asyncio.run(evaluate(cfg, policy=args.policy, split=args.split, limit=args.limit, job_dir=args.job_dir))
    if report.rows:
        print(format_table(report.rows))
    print(f"{cfg.env.name} [{args.split}] policy={args.policy}: reward {report['reward_mean']:.3f} "
          f"over {int(report['episodes'])} episodes ({int(report['failed'])} failed, "
          f"{int(report.metrics.get('refused', 0))} refused); "
          f"per-task results in {report.job_dir}/results.jsonl")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from miles_agent.config import load_config
    from miles_agent.registry import load

    planner = load("planners", "default")  # runtime/plan.py: the placement follows the Ray launcher's
    print(planner(load_config(args.recipe, list(args.overrides)), args.nodes, args.gpus_per_node, args.gpu_memory))
    return 0


def cmd_list(kind: str) -> int:
    from miles_agent.registry import list_plugins

    plugins = list_plugins(kind)
    if not plugins:
        print(f"no {kind} installed")
    width = max((len(p.name) for p in plugins), default=0)
    for p in plugins:
        if p.error:
            print(f"{p.name:<{width}}  [{p.package}]  BROKEN: {p.error}")
        else:
            print(f"{p.name:<{width}}  [{p.package}]  {p.description}")
    return 0


def cmd_sandbox_reap(args: argparse.Namespace) -> int:
    """Remove this project's sandboxes whose TTL has passed (backends with a ``reap`` method, e.g. docker)."""
    from miles_agent.registry import load
    from miles_agent.sandbox import SandboxError

    cls = load("sandboxes", args.backend)
    if not hasattr(cls, "reap"):
        raise UserError(f"sandbox backend {args.backend!r} has no reaper (its service enforces the TTL itself)")
    try:
        removed = cls.reap()
    except SandboxError as e:
        raise UserError(str(e)) from None
    print(f"removed {len(removed)} expired sandbox(es)" + "".join(f"\n  {r}" for r in removed))
    return 0


#: `sandbox exec`'s exit status when the command ran past --timeout (coreutils `timeout`'s convention).
SANDBOX_TIMEOUT_EXIT = 124
#: The exit status of a command whose reader closed the pipe: 128 + SIGPIPE, what a shell reports.
BROKEN_PIPE_EXIT = 141


def cmd_sandbox_exec(args: argparse.Namespace) -> int:
    """Run one command in a fresh sandbox, print its output, and exit with its exit code."""
    from miles_agent.registry import load
    from miles_agent.sandbox import SandboxError, SandboxLimits, SandboxSpec

    argv = args.cmd
    if not argv:
        raise UserError("no command given; usage: miles-agent sandbox exec [--backend NAME] -- CMD ...")
    cls = load("sandboxes", args.backend)
    sandbox = cls(isolation="none") if args.unisolated else cls()
    command = argv[0] if len(argv) == 1 else shlex.join(argv)

    async def run():  # noqa: ANN202
        try:
            await sandbox.start(SandboxSpec(limits=SandboxLimits(wall_time_s=args.timeout)))
            return await sandbox.exec(command)
        finally:
            await sandbox.stop()

    try:
        result = asyncio.run(run())
    except SandboxError as e:
        raise UserError(f"sandbox {args.backend!r} failed: {e}") from None
    try:
        _print_exec_result(result)
    except BrokenPipeError:  # the reader left early (`... | head`): stop quietly, as `cat` would
        return _stdout_closed()
    return SANDBOX_TIMEOUT_EXIT if result.timed_out else result.exit_code


def _print_exec_result(result: Any) -> None:
    print("--- stdout ---")
    print(result.stdout, end="" if result.stdout.endswith("\n") or not result.stdout else "\n")
    print("--- stderr ---")
    print(result.stderr, end="" if result.stderr.endswith("\n") or not result.stderr else "\n")
    print(f"--- exit code {result.exit_code} in {result.duration_s:.3f}s"
          + ("; timed out" if result.timed_out else "")
          + (f"; limit hit: {result.limit_hit}" if result.limit_hit else "")
          + ("; output truncated" if result.output_truncated else ""))
    sys.stdout.flush()  # inside the caller's try: a closed pipe surfaces here, not at interpreter exit


def _stdout_closed() -> int:
    """Point stdout at /dev/null so the interpreter's final flush cannot raise again (Python docs,
    "Note on SIGPIPE"), and exit as a process killed by SIGPIPE would."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return BROKEN_PIPE_EXIT


def cmd_warmstart(args: argparse.Namespace) -> int:
    from miles_agent.build import build_env
    from miles_agent.config import load_config
    from miles_agent.warmstart import build_warm_start, cache_path

    # As a run from the built-in warm start builds it: with the env options it is made for (warm_start_options).
    env = build_env(load_config(None, {"env.name": args.env, "model.warm_start": "builtin"}))
    out = Path(args.out) if args.out else cache_path(env, args.arch)
    metrics = build_warm_start(env, args.arch, out)
    print(f"warm start for {env.name} ({args.arch}) written to {out}; final SFT loss {metrics['loss']:.4f}")
    return 0


def add_observability_commands(sub: Any) -> None:
    r = sub.add_parser("report", help="an HTML page of a run's plots and sample trajectories")
    r.add_argument("run_dir", help="the run directory (train --run-dir)")
    r.add_argument("--out", help="output folder (default RUN_DIR/report)")
    p = sub.add_parser("replay", help="re-run training on a run's rollout dumps (no rollouts)")
    p.add_argument("run_dir", help="the run directory whose config.json and rollouts/ to use")
    p.add_argument("--rollouts", help="the dump folder (default RUN_DIR/rollouts)")
    p.add_argument("--from", dest="first", type=int, help="first dumped step to replay (default: the first)")
    p.add_argument("--to", dest="last", type=int, help="last step to replay (default: the last consecutive one)")
    p.add_argument("--out", help="write the replayed step records here as JSONL")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config changes to try, right after RUN_DIR, e.g. train.lr=1e-5")


def cmd_report(args: argparse.Namespace) -> int:
    from miles_agent.report import build_report

    page = build_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"report written to {page} (open it in a browser)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import json

    from miles_agent.replay import compare_lines, replay

    records = replay(Path(args.run_dir), Path(args.rollouts) if args.rollouts else None, args.first, args.last,
                     list(args.overrides))
    for line in compare_lines(records):
        print(line)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse; an override between options ("unrecognized arguments") gets the rule and the fixed line."""
    args, extra = parser.parse_known_args(argv)
    is_override = re.compile(r"^[A-Za-z_]\w*\.[\w.]+=").match
    if extra and all(is_override(a) for a in extra):
        fixed = [a for a in argv if not is_override(a)] + [a for a in argv if is_override(a)]
        parser.exit(2, f"miles-agent: error: overrides (section.key=value) go after all the options; "
                       f"{' '.join(extra)} came between options. Run:\n  miles-agent {shlex.join(fixed)}\n")
    return parser.parse_args(argv) if extra else args


def _os_error(e: BaseException | None, errnos: tuple[int, ...]) -> OSError | None:
    """The OSError with one of ``errnos`` behind ``e``: itself, its causes, or a rank's failure it carries."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        if (x := todo.pop()) is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in errnos:
            return x
        todo += [x.__cause__, x.__context__, *(f[0] if isinstance(f, tuple) else f
                                               for f in dict(getattr(x, "failures", None) or {}).values())]
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    command_after_dashes = None
    if argv[:1] == ["sandbox"] and "--" in argv:
        cut = argv.index("--")
        argv, command_after_dashes = argv[:cut], argv[cut + 1:]
    from miles_agent.server_flags import split_sglang_flags

    argv, sglang_flags = split_sglang_flags(argv) if command_after_dashes is None else (argv, {})
    args = _parse(build_parser(), argv)
    args.argv = argv
    args.sglang_server_args = sglang_flags  # --sglang-<arg> flags: SGLang server arguments, verbatim
    if command_after_dashes is not None:
        args.cmd = command_after_dashes
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "sandbox":
            return cmd_sandbox_reap(args) if args.action == "reap" else cmd_sandbox_exec(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "warmstart":
            return cmd_warmstart(args)
        if args.command in ("report", "replay"):
            return cmd_report(args) if args.command == "report" else cmd_replay(args)
        return cmd_list(args.command)
    except UserError as e:
        print(f"miles-agent: error: {e}", file=sys.stderr)
        return e.exit_code
    except RunAborted as e:  # a part died mid-run (trainer rank, engines past their restart budget)
        print(f"miles-agent: run stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("miles-agent: interrupted", file=sys.stderr)
        return 130
    except BaseException as top:  # an OSError, or one wrapped (torch's CheckpointException is a BaseException)
        if (e := _os_error(top, (errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS))) \
                and e.filename:
            print(f"miles-agent: error: {e.strerror}: {e.filename}; a folder on that path is a file, or it is not "
                  "writable: pick another path (--run-dir, --job-dir, --out)", file=sys.stderr)
            return 2
        if (e := _os_error(top, (errno.ENOSPC, errno.EDQUOT))) is None:
            raise
        print(f"miles-agent: error: no space left on the device writing {e.filename or 'the run directory'}; free "
              "space there (or pick another --run-dir) and rerun, with --resume to continue from the last "
              "checkpoint", file=sys.stderr)
        return 28


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
