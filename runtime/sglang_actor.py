"""SGLang servers as Ray actors (``cluster.mode=ray`` with ``rollout.engine=sglang``).

Each actor sits in its engine bundle of the run's placement group (so Ray sets its
``CUDA_VISIBLE_DEVICES``) and owns one `SGLangServer` process there: launch, health, restart, stop.
The driver talks HTTP to the servers directly (`SGLangEngine`); the actor is only the server's
keeper, so a server on another node is launched and supervised on that node.

With ``cluster.colocate=true`` server ``i`` shares trainer rank ``i``'s bundle and device and gives its
memory back around every train step (runtime/sglang_colocate.py). A server with ``tp_size`` k > 1 sits in
rank ``i * k``'s bundle and is pointed at the GPUs of ranks ``i * k .. i * k + k - 1`` (their
``CUDA_VISIBLE_DEVICES``, read off the ranks), which must be on one node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def remote_server_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class SGLangServerActor:
        def __init__(self, launch: str, model_path: str, server_args: dict[str, Any], log_path: str,
                     loopback: bool, visible_devices: str = "") -> None:
            import os

            from miles_agent.engines.sglang.server import SGLangServer, server_argv
            from miles_agent.transports.groups import free_port

            if visible_devices:  # a TP server over several colocated ranks' GPUs (the server inherits it)
                os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
            host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
            port = free_port(host)
            self._url = f"http://{host}:{port}"
            self.server = SGLangServer(server_argv(launch, model_path, host, port, server_args), self._url, log_path)
            self.server.start()
            from miles_agent.runtime.sglang_colocate import ServerMemory

            self.memory = ServerMemory(self.server, self._url)

        def url(self) -> str:
            return self._url

        def wait_ready(self, timeout_s: float) -> None:
            self.server.wait_ready(timeout_s)

        def alive(self) -> bool:
            return self.server.alive()

        def ensure_running(self, timeout_s: float) -> bool:
            return self.server.ensure_running(timeout_s)

        def stop(self) -> None:
            self.server.stop()

        def release_memory(self, timeout_s: float) -> list[str]:
            return self.memory.release(timeout_s)

        def resume_memory(self, tags: list[str], timeout_s: float) -> list[str]:
            return self.memory.resume(tags, timeout_s)

        def placement(self) -> dict[str, Any]:
            import os

            from miles_agent.runtime.ray_cluster import where_am_i

            return {**where_am_i(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    return SGLangServerActor


class ActorServer:
    """The `process` an `SGLangEngine` owns when its server lives in a Ray actor (same methods as
    `SGLangServer`: alive / wait_ready / ensure_running / stop)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def alive(self) -> bool:
        import ray

        try:
            return bool(ray.get(self.actor.alive.remote(), timeout=60))
        except Exception:  # noqa: BLE001 - a dead actor or node: the server is gone
            return False

    def wait_ready(self, timeout_s: float) -> None:
        import ray

        ray.get(self.actor.wait_ready.remote(timeout_s))

    def ensure_running(self, timeout_s: float) -> bool:
        import ray

        return bool(ray.get(self.actor.ensure_running.remote(timeout_s)))

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - already dead: nothing left to stop
            pass
        ray.kill(self.actor)


class SGLangActorGroup:
    """The run's SGLang server actors, as the Ray session sees its engines: ``kill`` on close and, when
    colocated, ``release_memory`` before every train step (the trainer group's ``before_train``)."""

    def __init__(self, engines: list[Any], control_timeout_s: float = 600.0) -> None:
        self.engines = engines
        self.control_timeout_s = control_timeout_s

    def release_memory(self) -> None:
        """Every server pauses (retracting requests) and frees its memory; blocking on purpose: the
        trainer ranks must not reload before the device is free. A dead server is restarted first."""
        import ray

        from miles_agent.errors import RunAborted
        from miles_agent.runtime.supervisor import actor_failures

        refs = [e.process.actor.release_memory.remote(self.control_timeout_s) for e in self.engines]
        for e, ref in zip(self.engines, refs):
            try:
                ray.get(ref, timeout=2 * self.control_timeout_s)
            except actor_failures() as err:
                raise RunAborted(f"the actor keeping SGLang server {e.url} died ({type(err).__name__}); "
                                 "rerun with --resume") from None
            except ray.exceptions.GetTimeoutError:
                raise RunAborted(f"SGLang server {e.url} did not release its memory within "
                                 f"{2 * self.control_timeout_s:g}s (sglang.control_timeout_s); see its log") from None
            except ray.exceptions.RayTaskError as err:
                raise RunAborted(f"SGLang server {e.url} could not release its memory for the train step: "
                                 f"{err.cause}") from None

    def kill(self) -> None:
        for e in self.engines:
            e.process.stop()


def span_devices(sess: Any) -> list[str]:
    """Per engine, the CUDA_VISIBLE_DEVICES of the colocated ranks it spans ("" = Ray's own for its bundle)."""
    p = sess.placement
    if p.engine_span <= 1:
        return [""] * len(p.engine_bundles)
    from miles_agent.errors import UserError

    if sess.trainer is None:
        raise UserError("colocated SGLang servers with sglang.tp_size > 1 take their GPUs from the trainer ranks; "
                        "build the trainer first (or set cluster.colocate=false)")
    ranks = sess.trainer.where()
    out = []
    for first in p.engine_bundles:
        span = ranks[first:first + p.engine_span]
        if len({r["node_id"] for r in span}) > 1:
            raise UserError(f"a server with sglang.tp_size={p.engine_span} would span nodes (ranks {first}.."
                            f"{first + p.engine_span - 1}); SGLang servers across nodes are not launched under Ray "
                            "yet: use a tp_size of at most the GPUs per node")
        out.append(",".join(g for r in span for g in r["gpu_ids"]))
    return out


def build_sglang_actor_engines(cfg: Any, model: Any, tokenizer: Any, sess: Any) -> list[Any]:
    """One server per engine bundle of the placement (``cluster.num_engines``), each launched by its actor."""
    from miles_agent.engines.sglang import client_options, connect_clients, launch_args, model_folder
    from miles_agent.engines.sglang.client import SGLangEngine
    from miles_agent.engines.sglang.server import DEFAULT_LAUNCH

    sg = cfg.sglang
    args = launch_args(sg)
    if cfg.cluster.colocate:  # server i in rank i's bundle: its memory must really go while the rank trains
        from miles_agent.runtime.sglang_colocate import MEMORY_SAVER_ARGS

        args = {**MEMORY_SAVER_ARGS, **args}
    model_path = model_folder(cfg, model, tokenizer)
    cls = remote_server_class()
    visible = span_devices(sess)
    actors = []
    try:
        for i in range(cfg.cluster.num_engines):
            log = str(Path(cfg.run.run_dir).resolve() / "sglang" / f"server{i}.log")
            actors.append(cls.options(**sess.placement.engine_options(i)).remote(
                sg.launch_command or DEFAULT_LAUNCH, model_path, args, log, sess.loopback, visible[i]))
        import ray

        urls = ray.get([a.url.remote() for a in actors])
        engines = [SGLangEngine(url, process=ActorServer(a), **client_options(cfg, model))
                   for url, a in zip(urls, actors)]
        for e in engines:
            e.process.wait_ready(sg.startup_timeout_s)
    except BaseException:
        import ray

        for a in actors:
            ray.kill(a)
        raise
    sess.engines = SGLangActorGroup(engines, sg.control_timeout_s)
    return connect_clients(cfg, engines)
