"""The Ray executor's optional path: every rank's `execute` as one Ray Compiled Graph
(`runtime.compiled_graph`; docs/distributed.md). `CompiledGraphPath` is mixed into
`RayExecutor`, which holds `actors`, `cfg`, `ray`, `dag`, `dag_broken`, `_call` and `_name`."""
from __future__ import annotations

import time

from pp_runtime.core.errors import CheckpointError, ConfigError, WorkerFailed

PING_S = 5.0  # how long a diagnosis waits for an actor's answer to a ping
PROGRESS_S = 1.0  # ... to `progress`, answered from the control group in milliseconds
GRAPH_AUTO = "auto"  # runtime.compiled_graph: decided by `graph_on` from the cluster


def graph_on(cfg, device: str, resources: dict, cores: int | None = None) -> bool:
    """Whether the stages run as one compiled graph: `runtime.compiled_graph` as given;
    auto: where it pays (`graph_pays`)."""
    setting = cfg.runtime.compiled_graph
    if setting != GRAPH_AUTO:
        return bool(setting)
    return graph_pays(cfg, device, resources, cores)


def graph_pays(cfg, device: str, resources: dict, cores: int | None = None) -> bool:
    """Where the graph pays: every stage has a processor of its own for the graph's
    channels to poll on: the actors run on CUDA (`ray_device` gave each its GPU), or the
    cluster has a CPU per worker and one for the driver (tp * pp + 1). On fewer CPUs the
    polling takes the stages' compute (docs/distributed.md). `resources`:
    `ray.cluster_resources()`; `cores`: this machine's cores where the cluster is this
    machine alone (a local Ray may declare more logical CPUs than there are cores; the
    cores are what is shared)."""
    if device == "cuda":
        return True
    cpus = resources.get("CPU", 0)
    if cores is not None:
        cpus = min(cpus, cores)
    return cpus >= cfg.parallel.tp * cfg.parallel.pp + 1


def local_cores(ray) -> int | None:
    """This machine's cores when the Ray cluster is this machine alone, else None."""
    import os

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    here = ray.util.get_node_ip_address()
    if len(nodes) != 1 or nodes[0].get("NodeManagerAddress") != here:
        return None
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


class CompiledGraphPath:
    graph = False  # the stages run as one compiled graph (decided in `_start`)

    def _graph_wanted(self) -> bool:
        """`graph_on` for this executor's cluster, once, on the driver, after `ray_device`."""
        return graph_on(self.cfg, self.device, self.ray.cluster_resources(), local_cores(self.ray))

    def _compile(self):
        """Every rank's `execute(mb)` as one compiled graph: one `execute` per micro-batch."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as mb:
            graph = MultiOutputNode([a.execute.bind(mb) for a in self.actors])
        return graph.experimental_compile(_max_inflight_executions=self.cfg.in_flight + 1,
                                          _submit_timeout=self.cfg.runtime.step_timeout_s)

    def _gather_graph(self, refs: list, timeout_s: float, what: str) -> list:
        """The compiled graph's results in rank order; the first rank whose result does not
        come within timeout_s is named as hung, a rank that raised or died as failed."""
        from ray.exceptions import RayChannelTimeoutError, RayTaskError

        deadline, out = time.monotonic() + timeout_s, []
        for i, ref in enumerate(refs):
            try:
                out.append(self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except RayChannelTimeoutError:
                self.dag_broken = True
                raise WorkerFailed(f"{self._name(self._behind(i, (i,)))} did not finish {what} within "
                                   f"{timeout_s:g} s (runtime.step_timeout_s)") from None
            except RayTaskError as exc:  # the rank's execute raised
                self.dag_broken = True
                cause = getattr(exc, "cause", None)
                if isinstance(cause, (CheckpointError, ConfigError)):
                    raise type(cause)(f"{self._name(i)}: {cause}") from exc
                raise WorkerFailed(f"{self._name(i)} failed during {what}: "
                                   f"{type(exc).__name__}: {first_line(exc)}") from exc
            except Exception as exc:  # the graph's channels closed: a rank died
                raise self._graph_failure(exc, what) from exc
        return out

    def _behind(self, first: int, pending=()) -> int:
        """The rank that hangs, where the others wait on it or ran ahead: the first that
        does not answer `progress` within PROGRESS_S (stopped, or holding its process), else
        the one with the fewest micro-batches started plus finished (a `pending` one, whose
        result is late, first among equals); `first` if no rank answers at all."""
        refs = [self._call(i, "progress") for i in range(len(self.actors))]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=PROGRESS_S)
        done = {}
        for ref in ready:
            try:
                done[refs.index(ref)] = self.ray.get(ref)
            except Exception:  # dead: as silent as a stopped one
                pass
        if not done:
            return first
        silent = [i for i in range(len(refs)) if i not in done]
        if silent:
            return silent[0]
        low = [i for i in range(len(refs)) if done[i] == min(done.values())]
        return next((i for i in low if i in pending), low[0])

    def _graph_failure(self, exc: BaseException, what: str) -> WorkerFailed:
        """WorkerFailed naming the first rank that no longer answers (a dead actor breaks
        the whole graph, so its error alone does not say which)."""
        self.dag_broken = True
        refs = [self._call(i, "ping") for i in range(len(self.actors))]
        for i, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=5)
            except Exception as dead:  # RayActorError / ActorDiedError
                return WorkerFailed(f"{self._name(i)} failed during {what}: "
                                    f"{type(dead).__name__}: {first_line(dead)}")
        return WorkerFailed(f"the compiled graph failed during {what}: "
                            f"{type(exc).__name__}: {first_line(exc)}")



def teardown(dag, broken: bool = False) -> None:
    """Stop the graph's loops on the actors and free its channels. A broken graph's
    teardown finds dead actors: Ray would log each with a traceback, after the failure
    was already reported by name, so its logger is quiet meanwhile."""
    import logging

    log = logging.getLogger("ray.dag.compiled_dag_node")
    level = log.level
    if broken:
        log.setLevel(logging.CRITICAL)
    try:
        dag.teardown()
    except Exception:  # actors already gone: nothing left to stop
        pass
    finally:
        log.setLevel(level)



def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((line for line in reversed(text) if line.strip()), type(exc).__name__)[:300]
