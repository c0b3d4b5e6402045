"""Assembly: a coserve server built from its `ServeOptions`, in one process or on Ray.

- `--local` (`build_local_app`, `run_local`): one process. The scheduler's coroutines run on uvicorn's
  event loop, the engine loop on a background thread (`coserve.actors.client.LocalSchedulerClient`).
- default (`run_ray`): Ray (a local cluster unless `RAY_ADDRESS` is set). The SchedulerActor is a named
  async actor, the `--engines` EngineActors hold one GPU each (`engine_pool`: a placement group), and the
  gateway is a Ray Serve ingress deployment: the same FastAPI app, built in the replica
  (`GatewayIngress`), which starts and owns the actors (`start_ray_actors`). `deploy/serve.yaml` runs the
  same application on an existing cluster.

On Ray there is one ingress deployment (one replica: the scheduler is central). The replica owns the
actors, so Serve's lifecycle is the application's: `serve shutdown`, `serve delete coserve` or a new
config stop the replica, its `__del__` tells the scheduler to end the streams in flight, and Ray ends
the actors with their owner. A restarted replica starts fresh actors, and the job manager resumes
running jobs from their last checkpoint (the store and the adapters are in the data dir).

The data dir is locked by the scheduler (`coserve.actors.data_dir_lock`): with `--local` before the
model loads; on Ray by the scheduler actor, so an application started while another server serves the
same data dir fails to deploy, its error naming the dir and the holder.

`app_builder` is Serve's application-builder entry point: `import_path: coserve.server.assembly:app_builder`
with `args` named like `coserve serve`'s flags (`model`, `tenants`, `data_dir`, `max_num_seqs`, ...).
Host and port are Serve's `http_options`, not arguments.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from coserve.server.engine_pool import RAY_NAMESPACE, actor_name
from coserve.server.options import ServeOptions, options_from_args

logger = logging.getLogger(__name__)

ENGINE_ID = "engine-0"  # the engine with --local, and the first on Ray

SCHEDULER_ACTOR = "coserve-scheduler"
ENGINE_ACTOR = actor_name(ENGINE_ID)
APP_NAME = "coserve"
DEPLOYMENT_NAME = "coserve-gateway"
# The replica is an async gateway in front of the scheduler, which queues, orders (VTC) and batches the
# requests itself: Serve's default of 5 ongoing requests per replica would queue the rest in Serve's
# proxy, first come first served, and their TTFT would grow by whole requests (measured: 64 streaming
# clients waited 13.7 s at the median for a first token, against 65 ms with `--local`).
MAX_ONGOING_REQUESTS = 100_000


class PortUnavailable(RuntimeError):
    """The host and port cannot be listened on (in use, or not an address of this machine)."""


# ----------------------------------------------------------------------------- the gateway (both modes)

def gateway_app(opts: ServeOptions, tenants: Any, store: Any, scheduler: Any, layout: Any,
                dedicated: Any = None) -> Any:
    """The gateway's FastAPI app over a scheduler client (`LocalSchedulerClient` or `RaySchedulerClient`): its
    `SchedulerFrontend` holds the tokenizer (prompts in, text out); the scheduler sees token ids.
    `dedicated`: the Ray cluster's room for dedicated fine-tuning runs (None with `--local`)."""
    from coserve.api.app import build_app
    from coserve.api.protocol.models import ModelServing
    from coserve.frontend.scheduler_frontend import SchedulerFrontend
    from coserve.graders.python_grader import PythonGraderRunner

    frontend = SchedulerFrontend.for_engine(opts.model, scheduler, layout, chat_template=opts.chat_template_text())
    serving = ModelServing(engine=layout.engine, dtype=layout.dtype)
    logger.info("coserve: %s is served by %s", opts.base_model_id, serving_words(serving.engine, serving.dtype))
    return build_app(store, tenants, [opts.base_model_id], scheduler=frontend, max_lora_rank=layout.max_lora_rank,
                     public_metrics=opts.public_metrics, max_request_bytes=opts.max_request_bytes, max_n=opts.max_n,
                     max_upload_bytes=opts.max_upload_bytes, dedicated=dedicated,
                     python_graders=PythonGraderRunner() if opts.enable_python_graders else None,
                     lenient_params=opts.lenient_params, serving=serving)


def serving_words(engine: str, dtype: str) -> str:
    """What the banner and the log say of the engine serving: "engine torch, dtype float32"."""
    return f"engine {engine}, dtype {dtype}"


# ----------------------------------------------------------------------------------- local mode

def build_local_app(opts: ServeOptions) -> Any:
    """The FastAPI app with the scheduler and engine in this process (started by the app's lifespan)."""
    from coserve.actors.client import LocalSchedulerClient
    from coserve.actors.data_dir_lock import DataDirLock
    from coserve.actors.engine_actor import EngineActor
    from coserve.actors.scheduler_actor import SchedulerActor
    from coserve.contract.kv_capacity import check_kv_capacity
    from coserve.store import MetadataStore

    tenants = opts.load_tenants()
    # First, before the model loads and before anything opens the store: a second server on this data
    # dir stops here (DataDirLocked). The scheduler, which owns the jobs, keeps the lock.
    lock = DataDirLock.acquire(opts.data_dir)
    try:
        engine = EngineActor(opts.engine_config(), ENGINE_ID)
        check_kv_capacity(engine.layout())  # one max_model_len sequence beside a fine-tuning window
        scheduler = SchedulerActor(opts.scheduler_settings(tenants), opts.policy_factory(tenants), data_lock=lock)
        return gateway_app(opts, tenants, MetadataStore(opts.data_dir), LocalSchedulerClient(scheduler, engine),
                           engine.layout())
    except BaseException:
        lock.release()
        raise


def run_local(opts: ServeOptions) -> None:
    """Serve with uvicorn until interrupted. The socket is bound first, so the banner names the port that
    is actually listening (`--port 0` picks a free one) and a port in use fails before the model loads."""
    import socket

    import uvicorn

    family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((opts.host, opts.port))
    except OSError as error:
        sock.close()
        raise PortUnavailable(f"--host {opts.host} --port {opts.port}: cannot listen there "
                              f"({error.strerror})") from None
    sock.listen(2048)
    port = sock.getsockname()[1]
    app = build_local_app(opts)
    serving = app.state.gateway.serving  # the engine's own word: its layout
    print(f"coserve: serving {opts.base_model_id} on http://{opts.host}:{port}/v1 (local mode, "
          f"{serving_words(serving.engine, serving.dtype)})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down cleanly (uvicorn.run too)
        pass


# ------------------------------------------------------------------------------------- Ray mode

class GatewayIngress:
    """The gateway's Serve replica: starts the scheduler and the engines, then serves the FastAPI app.

    Args:
        opts: the serve options (model, tenants file, data dir, scheduler and engine settings).
    """

    def __init__(self, opts: ServeOptions) -> None:
        from coserve.actors.client import RaySchedulerClient
        from coserve.store import MetadataStore

        self._opts = opts
        self._tenants = opts.load_tenants()
        engines = opts.num_engines()  # the cluster's GPUs (or cores): EnginesUnavailable when too few
        self._capacity = dedicated_capacity(opts, engines)
        self._capacity.check_default()  # routed jobs' workers must fit the cluster (ClusterTooSmall)
        # The scheduler actor takes the data dir's lock first (DataDirLocked, inside the actor's creation
        # error, when another server holds it): the store is opened only once this server owns the dir.
        self._scheduler_actor, self._engines, self._layout = start_ray_actors(opts, self._tenants, engines)
        self._store = MetadataStore(opts.data_dir)
        self._scheduler = RaySchedulerClient(self._scheduler_actor)

    def __serve_build_asgi_app__(self) -> Any:
        return gateway_app(self._opts, self._tenants, self._store, self._scheduler, self._layout,
                           dedicated=self._capacity)

    def __del__(self) -> None:
        # Serve calls this on a graceful shutdown (and Python may again at collection): fail the streams
        # in flight with a clear error instead of cutting them. Not awaited: the actors end with this
        # replica either way.
        actor = getattr(self, "_scheduler_actor", None)
        if actor is not None:
            try:
                actor.shutdown.remote()
            except Exception:  # noqa: BLE001 - Ray may already be gone at interpreter exit
                logger.debug("scheduler shutdown not sent", exc_info=True)


def build_application(opts: ServeOptions) -> Any:
    """The Serve application (`serve.run(...)` it) for already validated options."""
    from ray import serve

    ingress = serve.deployment(name=DEPLOYMENT_NAME, num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": 0})(serve.ingress()(GatewayIngress))
    return ingress.bind(opts)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path: coserve.server.assembly:app_builder`).

    Raises:
        ValueError: a bad argument; `EnginesUnavailable` (a ValueError) when `engines` is more than the
            cluster's GPUs (or CPUs), read from the cluster when Ray is connected (`serve run`,
            `serve deploy`).
    """
    opts = options_from_args(args)
    opts.num_engines()
    return build_application(opts)


def dedicated_capacity(opts: ServeOptions, engines: int) -> Any:
    """The cluster's room for dedicated fine-tuning workers, beyond the engines' GPUs (CPUs on the CPU)."""
    from coserve.dedicated.capacity import ClusterCapacity
    from coserve.server.engine_pool import engine_bundle

    held = {name: amount * engines for name, amount in engine_bundle(opts.device).items()}
    return ClusterCapacity(opts.dedicated_settings(), held)


def start_ray_actors(opts: ServeOptions, tenants: Any, engines: int) -> tuple[Any, Any, Any]:
    """Create the named SchedulerActor and `engines` EngineActors (`EnginePool`: one GPU each, pinned by a
    placement group), register the engines, start their loops.

    The caller owns them (the gateway's Serve replica, `GatewayIngress`): they end with it.

    Returns:
        (scheduler handle, the `EnginePool`, the first engine's layout); the actors are named
        `SCHEDULER_ACTOR` and `coserve-engine-<i>` in `RAY_NAMESPACE`.
    """
    import ray

    from coserve.actors.engine_actor import RayLink
    from coserve.actors.scheduler_actor import SchedulerActor
    from coserve.contract.kv_capacity import check_kv_capacity
    from coserve.server.engine_pool import EnginePool

    # Every engine's bundle is reserved first: a cluster that cannot hold them fails here, clearly.
    pool = EnginePool.create(opts.engine_config(), engines)
    scheduler = ray.remote(SchedulerActor).options(name=SCHEDULER_ACTOR, namespace=RAY_NAMESPACE,
                                                   num_cpus=0).remote(opts.scheduler_settings(tenants),
                                                                      opts.policy_factory(tenants))
    layouts = pool.layouts()
    for layout in layouts.values():  # one max_model_len sequence beside a fine-tuning window
        check_kv_capacity(layout)
    link = RayLink(scheduler)
    for engine_id, engine in pool.handles.items():
        ray.get(scheduler.register_engine.remote(
            engine_id, layouts[engine_id]))
        # max_restarts: a crashed engine comes back (the scheduler's supervisor restarts its loop); calls
        # in flight when it died fail rather than being retried on the new one.
        ray.get(engine.start.remote(link))
        ray.get(scheduler.supervise.remote(
            engine_id, engine, link))
    return scheduler, pool, next(iter(layouts.values()))


def deploy_gateway(opts: ServeOptions) -> None:
    """Start Ray Serve's HTTP proxy on `opts.host:opts.port` and run the application at `/` (its replica
    starts the scheduler and the engine; returns once it serves)."""
    from ray import serve

    serve.start(http_options={"host": opts.host, "port": opts.port})
    serve.run(build_application(opts), name=APP_NAME, route_prefix="/")


def run_ray(opts: ServeOptions) -> None:
    """Serve on Ray until interrupted; then shut the application and the actors down."""
    import ray
    from ray import serve

    from coserve.actors.data_dir_lock import DataDirLock

    # The scheduler actor takes the data dir's lock in its own process; a second server stops here first,
    # before Ray starts (DataDirLocked), instead of after a failed deployment.
    DataDirLock.check_free(opts.data_dir)
    dashboard: dict[str, Any] = {} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}
    ray.init(namespace=RAY_NAMESPACE, log_to_driver=True, **dashboard)
    try:
        # Before deploying, on the cluster now connected: a clear error, not a failed replica.
        dedicated_capacity(opts, opts.num_engines()).check_default()
    except BaseException:
        ray.shutdown()
        raise
    deploy_gateway(opts)
    # The engines' layouts are in the replica; the dtype they resolved is the one resolved here.
    print(f"coserve: serving {opts.base_model_id} on http://{opts.host}:{opts.port}/v1 (Ray Serve, "
          f"{serving_words(opts.engine.value, opts.resolved_dtype())})", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` shuts down as cleanly as Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # The replica's shutdown ends the scheduler's streams, then its actors.
        serve.shutdown()
        ray.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
