"""Start `pp-runtime serve`: uvicorn at once, the stage workers behind it.

The HTTP port opens first, so `/health` answers while the workers start (503, "starting")
and turns 200 once every stage is up: Slurm scripts and load balancers wait on it. A start
that fails is reported at `/health` and in the log, and the server exits with code 1.
While it serves, a liveness probe asks every stage worker for a reply every
`LIVENESS_PROBE_S` when the engine is idle (a busy engine finds a dead worker itself), so
a dead worker is found within seconds even with no traffic: the engine replaces the
workers (`/health` 503 "recovering" meanwhile, docs/recovery.md), or, with recovery off or
its budget spent, `/health` stays 503.

One shutdown path, whatever sends SIGTERM or SIGINT (the PID or its process group;
idle, busy or starting): the signal aborts every open request at once (each open stream
gets an error event and [DONE]), uvicorn closes the port and waits for the connections to
drain, the workers are released (a local Ray and every actor stopped; Ray's processes are
in their own process group, so a group signal does not kill them first), and the command
exits 143 / 130 (`cli/main.py`).
"""
from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn

from pp_runtime.config import Config, ConfigError
from pp_runtime.core.errors import StartCancelled
from pp_runtime.serve.app import ServeState, build_app
from pp_runtime.serve.metrics import ServeMetrics, TeeSink
from pp_runtime.telemetry.metrics import deployment_tag

log = logging.getLogger("pp_runtime.serve")


LIVENESS_PROBE_S = 2.0  # how often an idle server checks that every stage worker answers
PROBE_TIMEOUT_S = 5.0  # a reply later than this is inconclusive (a busy worker), not a death


def serve(cfg: Config, checkpoint: str | Path | None, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_waiting: int | None = 1024,
          max_body_bytes: int = 4 * 2**20) -> int:
    """Serve `cfg` until stopped; the exit code (0, or 1 when the workers failed to start)."""
    state = ServeState(cfg.model.name, cfg.seq_len, cfg.model.vocab_size, cfg.runtime.seed,
                       ServeMetrics(deployment_tag(cfg)), api_key, max_body_bytes)
    stop = threading.Event()

    @asynccontextmanager
    async def lifespan(app):
        owner = threading.Thread(target=_own_workers, name="pp-serve-workers", daemon=True,
                                 args=(state, cfg, checkpoint, max_waiting, stop, server))
        owner.start()
        try:
            yield
        finally:
            stop.set()
            owner.join(timeout=60)

    sock = _listen(host, port)  # before any worker starts: a taken port fails at once
    port = sock.getsockname()[1]  # --port 0: the one the system picked
    server = _Server(uvicorn.Config(build_app(state, lifespan), host=host, port=port,
                                    log_level="info", timeout_graceful_shutdown=5), state)
    print(f"pp-runtime serve: {state.model} at http://{host}:{port}/v1 (OpenAI API); "
          f"GET /health turns 200 when every stage is up", flush=True)
    server.run(sockets=[sock])
    if state.error:
        print(f"error: the server could not start: {state.error}", file=sys.stderr)
        return 1
    return 0


class _Server(uvicorn.Server):
    """uvicorn's server, whose stop signal first ends every open request: the graceful
    shutdown then has no stream to wait for."""

    def __init__(self, config: uvicorn.Config, state: ServeState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        engine = self.state.engine
        if engine is not None:  # on a thread, not in the signal handler: close() takes a lock
            threading.Thread(target=engine.close, kwargs={"timeout": 0}, daemon=True,
                             name="pp-serve-abort").start()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there: {exc.strerror}") from None
    return sock


def _own_workers(state: ServeState, cfg: Config, checkpoint, max_waiting,
                 stop: threading.Event, server) -> None:
    """Build tokenizer, executor and engine (minutes on a cluster; then /health is 200), hold
    them until `stop`, release them. One thread does all three and lives as long as the
    server: a local Ray's own processes die with the thread that started them (they are
    started with PR_SET_PDEATHSIG, which follows the parent thread, not the process)."""
    from pp_runtime.engine.online import Engine
    from pp_runtime.executors import make_executor
    from pp_runtime.engine.llm import torch_thread_init
    from pp_runtime.serve.text import HFCodec, load_codec

    t0, executor = time.perf_counter(), None
    try:
        codec = load_codec(checkpoint)
        if cfg.runtime.threads_per_worker:  # the local executor computes on the engine thread
            import torch
            torch.set_num_threads(cfg.runtime.threads_per_worker)
        executor = make_executor(cfg, checkpoint, cancel=stop)  # a stop gives up the start
        sink = state.metrics.sink
        if executor.name == "ray" and cfg.runtime.metrics:  # also Ray's export (monitoring.md)
            from pp_runtime.telemetry.metrics import default_sink
            sink = TeeSink(sink, default_sink())
        engine = Engine(cfg, executor, sink=sink, max_waiting=max_waiting,
                        thread_init=torch_thread_init())
        state.codec, state.engine = codec, engine
        text = ("tokenizer from the checkpoint" if isinstance(codec, HFCodec)
                else "no tokenizer: text is space-separated token ids")
        print(f"pp-runtime serve: ready in {time.perf_counter() - t0:.1f} s: {cfg.parallel.pp} "
              f"stage(s) x tp {cfg.parallel.tp} on {executor.describe()}; {text}", flush=True)
        _probe_until(stop, state, executor, engine)
    except StartCancelled:  # stopped while starting: the signal decides the exit
        log.info("stopped while the stage workers were starting")
    except Exception as exc:
        log.exception("the stage workers could not start")
        state.error = f"{type(exc).__name__}: {exc}"
        server.should_exit = True
    finally:
        if state.engine is not None:
            state.engine.close(timeout=10.0)  # open requests end aborted
        if executor is not None:
            executor.shutdown()


def _probe_until(stop: threading.Event, state: ServeState, executor, engine) -> None:
    """Until `stop`: while the engine is idle, check every `LIVENESS_PROBE_S` that every
    stage worker answers (`executor.ping`); a dead one makes `/health` 503 and every new
    request 503 (`state.failure`). Executors in this process have no ping: nothing to do."""
    ping = getattr(executor, "ping", None)
    while not stop.wait(LIVENESS_PROBE_S):
        if ping is None or state.failure or not engine.healthy or engine.recovering:
            continue
        if engine.num_running() or engine.num_waiting():
            continue  # a busy engine finds a dead worker at its next micro-batch
        try:
            ping(PROBE_TIMEOUT_S)
        except Exception as exc:  # WorkerFailed naming the stage and rank
            if engine.report_failure(exc):  # the engine replaces the workers
                log.warning("liveness probe: %s; recovering", exc)
                continue
            state.failure = f"{type(exc).__name__}: {exc}"
            log.error("liveness probe: %s; /health is 503", state.failure)
