"""The Ray executor's compiled-graph path (`runtime.compiled_graph`; docs/distributed.md):
every rank's `execute` joined into one Ray Compiled Graph (`ray.dag`,
`experimental_compile`), one `dag.execute(mb)` per micro-batch that reaches every actor
through the graph's channels. `graph_on` decides, once, whether it runs; `GraphPath` is
its `Transport` (`ray_transport.py`), naming faults by the one diagnosis (`ray_ranks.py`)."""
from __future__ import annotations

import time

from pp_runtime.core.batch import MicroBatch, RankResult
from pp_runtime.executors.ray_ranks import kill_actors

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


class GraphPath:
    """The compiled graph as a `Transport`: compiled by `start` once the actors are up
    (again after a recovery); its actors are plain (the graph loop runs on a thread of
    its own, so `ping` and `progress` still answer)."""

    path, how, concurrency_groups, relay = "graph", "compiled graph", False, False

    def __init__(self, ranks, max_inflight: int, submit_timeout_s: float):
        self.ranks, self.dag = ranks, None
        self.max_inflight, self.submit_timeout_s = max_inflight, submit_timeout_s

    def start(self) -> None:
        """Every rank's `execute(mb)` as one compiled graph."""
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as mb:
            graph = MultiOutputNode([a.execute.bind(mb) for a in self.ranks.actors])
        self.dag = graph.experimental_compile(_max_inflight_executions=self.max_inflight,
                                              _submit_timeout=self.submit_timeout_s)

    def submit(self, mb: MicroBatch) -> list:
        try:
            return self.dag.execute(mb)  # one ref per rank
        except Exception as exc:  # the graph is broken: a rank died
            raise self.ranks.failure(None, exc, f"micro-batch {mb.mb_id}") from exc

    def gather(self, refs: list, timeout_s: float, what: str) -> list[RankResult]:
        """The results in rank order; the first rank whose result does not come within
        timeout_s starts the hang's diagnosis, a rank that raised is named as failed, a
        closed channel (a rank died) by the first dead rank."""
        from ray.exceptions import RayChannelTimeoutError, RayTaskError

        deadline, out = time.monotonic() + timeout_s, []
        for i, ref in enumerate(refs):
            try:
                out.append(self.ranks.ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except RayChannelTimeoutError:
                raise self.ranks.hung([i], timeout_s, what) from None
            except RayTaskError as exc:  # the rank's execute raised
                raise self.ranks.failure(i, exc, what) from exc
            except Exception as exc:  # the graph's channels closed: a rank died
                raise self.ranks.failure(None, exc, what) from exc
        return out

    def teardown(self, broken: bool) -> bool:
        """Stop the graph's loops and free its channels; a broken graph after its actors
        are killed (a hung or dead rank would hold its teardown up)."""
        dag, self.dag = self.dag, None
        if dag is None:
            return not broken
        if broken:
            kill_actors(self.ranks.actors)
        _teardown(dag, broken)
        return not broken


def _teardown(dag, broken: bool) -> None:
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
