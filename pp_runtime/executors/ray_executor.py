"""The Ray executor: one actor per (stage, TP rank) (`ray_actor.StageActor`), activations
over torch.distributed.

Placement: one placement-group bundle per stage holding its tp workers (a bundle never
spans nodes, so a stage's TP group is packed on one node and its all-reduces stay on
NVLink), bundles spread over nodes (SPREAD). Rank r = stage * tp + tp_rank.

Device and backend are decided once, here on the driver (`ray_device`): CUDA + NCCL when
the cluster has a GPU per worker (device auto) or the config says cuda, else CPU + gloo.
Each actor is given that device; Ray shows an actor with `num_gpus=1` only its own GPU,
as cuda:0, so `device: cuda:N` is rejected. After the process groups are up every rank
warms its communicators up (`parallel/p2p.warm_up`) before the first micro-batch.

How a micro-batch reaches the actors is one `Transport` (`ray_transport.py`), chosen once
in `_start`: a task per actor (`execute(mb)` to every actor in rank order, the
`MicroBatch` by value: inlined in each task, cheaper than one `ray.put` at this size);
with `runtime.tp_relay` (opt-in) and tp > 1 the relay (one task per stage, to its TP
rank 0, which relays the plan to its TP peers over a gloo control group of the stage;
`ray_relay.py`); with the compiled graph (`runtime.compiled_graph`: auto, on where every
stage has a GPU or a core of its own; docs/distributed.md) one `dag.execute(mb)` that
reaches every actor through the graph's channels (`ray_graph.py`). Either way an actor
runs its micro-batches in submission order, so point-to-point pairs always match and up
to `in_flight` micro-batches overlap in the pipeline (activations go between stages over
torch.distributed, not through Ray).
`wait` collects every rank's `RankResult` in rank order (the token ids from TP rank 0 of
the last stage, a `StageTiming` from every rank) and `assemble`s the SampledTokens.

Faults: an actor that dies, a call that raises, or a rank that does not finish within
`runtime.step_timeout_s` (or `startup_timeout_s` while starting) raises `WorkerFailed`
naming the stage and rank, by the one diagnosis of every path (`ray_ranks.py`; with the
relay the driver waits on every `follow()` call with each micro-batch, so a follower that
dies is named at once). A hung rank is told apart from the ranks that wait on it by
`progress`, answered from a concurrency group of its own (the rank that does not answer,
else the one furthest behind); the driver then ends every unfinished request
with finish reason `error`, and `shutdown()` kills every actor and removes the placement
group.
An interrupt (Ctrl-C, SIGTERM) while starting or running ends the same way, and a local
Ray the executor started is stopped with every process of it (`shutdown_ray`): nothing is
left running or listening (docs/errors.md).

Names, for the dashboard and `ray list actors`: every actor is named
`pp-<deployment>-<executor id>-s<stage>-tp<rank>` in namespace `pp_runtime` (the id, six hex
digits per executor, keeps two LLMs on one Ray apart), its repr says
`stage=1 tp_rank=0 layers [6, 12) node 10.0.0.2`, and every call is a task named
`stage<s>-tp<r>.<method>` (`stage1-tp0.execute`). The actors are not detached: they die
with the driver at the latest, and `shutdown()` kills them.
"""
from __future__ import annotations

import threading
import time
import uuid
import weakref
from pathlib import Path

from pp_runtime.core.batch import MicroBatch, SampledTokens, assemble
from pp_runtime.config import Config
from pp_runtime.core.errors import ConfigError, WorkerFailed
from pp_runtime.costmodel.balance import resolve_layer_split
from pp_runtime.executors import token_hop_on
from pp_runtime.executors.local_ray import shutdown_ray, start_ray
from pp_runtime.executors.ray_actor import stage_actor_class
from pp_runtime.executors.ray_graph import graph_on, local_cores
from pp_runtime.executors.ray_ranks import Ranks, kill_actors
from pp_runtime.executors.ray_transport import Transport, TaskPath, choose
from pp_runtime.parallel.groups import DistSpec
from pp_runtime.telemetry.metrics import deployment_tag

NAMESPACE = "pp_runtime"  # Ray namespace of every stage actor (`ray list actors` shows it)


class RayExecutor:
    name = "ray"

    def __init__(self, cfg: Config, checkpoint: str | Path | None = None,
                 cancel: threading.Event | None = None):
        import ray

        cfg = resolve_layer_split(cfg)  # an auto split chosen here if no caller chose it
        self.cfg, self.ray = cfg, ray
        p, rt = cfg.parallel, cfg.runtime
        self.tp, self.pp = p.tp, p.pp
        _check_device(rt.device)  # before anything starts
        self._owns_ray = not ray.is_initialized()
        self.ranks = Ranks(ray, p.tp, p.pp, rt.step_timeout_s)
        self.ranks.cancel = cancel  # while starting: set = stop waiting, from any thread
        self.actors, self._pgs = self.ranks.actors, []  # what _release frees
        self.transport: Transport = TaskPath(self.ranks)  # chosen in `_start`
        self.token_hop = False  # runtime.token_hop, resolved in `_start` (executors.token_hop_on)
        # an executor dropped without shutdown() still frees its actors when collected
        self._finalizer = weakref.finalize(self, _release, self.actors, self._pgs, False)
        try:
            if self._owns_ray:
                start_ray(rt.ray_address, p.tp * p.pp)
            self._start(checkpoint)
        except BaseException:  # a failure, or Ctrl-C / SIGTERM while starting: stop what started
            self.shutdown()
            raise
        finally:
            self.ranks.cancel = None

    # ---- startup ---------------------------------------------------------------------
    def _start(self, checkpoint) -> None:
        import torch
        from ray.util.placement_group import placement_group

        from pp_runtime.worker.device import dist_backend

        ray, cfg, rt = self.ray, self.cfg, self.cfg.runtime
        self.device = ray_device(cfg, ray.cluster_resources())  # the one decision
        self.backend = dist_backend(torch.device(self.device))
        gpus = 1 if self.device == "cuda" else 0
        bundle = {"CPU": self.tp, **({"GPU": self.tp} if gpus else {})}
        pg = placement_group([dict(bundle) for _ in range(self.pp)], strategy="SPREAD")
        self._pgs.append(pg)
        if not self.ranks.wait([pg.ready()], time.monotonic() + rt.startup_timeout_s)[0]:
            raise WorkerFailed(f"Ray could not place {self.pp} stages of {bundle} within "
                               f"{rt.startup_timeout_s} s; is the cluster big enough?") from None
        graph = graph_on(cfg, self.device, ray.cluster_resources(), local_cores(ray))
        self.transport = choose(self.ranks, cfg, graph)  # the one decision of the path
        self.token_hop = token_hop_on(cfg, self.transport.path or "ray")  # the workers get it
        # off the graph, probes answer from a concurrency group of their own while a rank
        # waits inside `execute`: a hang is named by progress, not by which result is late
        self.ranks.controlled = self.transport.concurrency_groups
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        self._start_workers()

    def _start_workers(self) -> None:
        """One actor per rank on the placement group, the process groups formed, the
        weights loaded, the transport started (a start and a recovery)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, rt, pg, ranks = self.cfg, self.cfg.runtime, self._pgs[0], self.ranks
        staged = cfg.with_layer_split_resolved().with_overrides(  # "auto" chosen here once,
            **{"runtime.token_hop": self.token_hop})  # both sent as what every rank runs
        gpus = 1 if self.device == "cuda" else 0
        actor_cls = stage_actor_class(self.ray, ranks.controlled)
        prefix = f"pp-{deployment_tag(cfg)}-{uuid.uuid4().hex[:6]}"  # unique per executor
        self.actor_names = [f"{prefix}-s{s}-tp{r}" for s in range(self.pp) for r in range(self.tp)]
        for i, name in enumerate(self.actor_names):  # rank order
            stage, r = divmod(i, self.tp)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=stage)
            self.actors.append(actor_cls.options(
                name=name, namespace=NAMESPACE, num_cpus=1, num_gpus=gpus,
                scheduling_strategy=strategy).remote(staged, stage, r, self.checkpoint, self.device))
        every, start_s = range(len(self.actors)), rt.startup_timeout_s

        def gather(refs, what):
            return ranks.gather(refs, start_s, what, "runtime.startup_timeout_s")

        local, t0 = rt.ray_address is None, time.monotonic()
        addr, port = gather([ranks.call(0, "rendezvous_address", local)],
                            "finding a rendezvous address")[0]
        spec = DistSpec(rt.dist_addr or addr, rt.dist_port or port, self.tp, self.pp,
                        self.backend, rt.step_timeout_s)
        t1 = time.monotonic()
        self.warm_ups = gather([ranks.call(i, "start", spec, self.transport.relay) for i in every],
                               "joining the process group and loading weights")
        t2 = time.monotonic()
        spans = gather([ranks.call(s * self.tp, "layers") for s in range(self.pp)],
                       "reporting its layers")
        times = gather([ranks.call(i, "start_times") for i in every], "reporting its start")
        self.start_phases = {"actors up": t1 - t0, "start": t2 - t1,  # seconds, slowest rank
                             **{k: max(r[k] for r in times) for k in times[0]}}
        self.layer_split = [int(k) if float(k).is_integer() else k  # what the workers hold
                            for k in (hi - lo for lo, hi in spans)]  # (reports), half layers too
        self.transport.start()

    def recover(self) -> None:
        """Replace every stage worker after a failure (engine/recovery.py): the actors are
        killed, dead, hung or alive (a process group takes no new member without every
        rank joining again, and a communicator that saw a peer die is not trusted), and
        fresh ones start on the same placement group: new process groups on a new port,
        weights loaded again, the same transport started again. Raises as a start does
        (WorkerFailed, CheckpointError)."""
        self.transport.teardown(broken=True)  # after a fault nothing is asked
        kill_actors(self.actors)
        self.ranks.broken = False
        self._start_workers()

    # ---- the executor interface --------------------------------------------------------
    @property
    def path(self) -> str:
        """"graph", "relay" or "" (a task per actor): what a calibration is kept under."""
        return self.transport.path

    def describe(self) -> str:
        hop = " + token hop" if self.token_hop else ""
        return f"ray ({len(self.actors)} actors, {self.backend}, {self.transport.how}){hop}"

    def submit(self, mb: MicroBatch) -> tuple[int, object]:
        return mb.mb_id, self.transport.submit(mb)

    def wait(self, handle: tuple[int, object]) -> SampledTokens:
        mb_id, refs = handle
        results = self.transport.gather(refs, self.cfg.runtime.step_timeout_s,
                                        f"micro-batch {mb_id}")
        return assemble(mb_id, results)  # rank order

    def ping(self, timeout_s: float) -> bool:
        """Ask every actor for a reply (a liveness probe, from any thread): WorkerFailed
        naming the first that died; False when one is slow to answer (busy: no verdict)."""
        return self.ranks.ping(timeout_s)

    def shutdown(self) -> None:
        """Stop the transport (a healthy compiled graph torn down, the follow loops ended),
        kill every actor (their process groups go with them) and free the placement. After
        a fault nothing is asked: a hung or dead rank would hold the stop up."""
        self._finalizer.detach()
        graceful = self.transport.teardown(self.ranks.broken)
        _release(self.actors, self._pgs, self._owns_ray, graceful)
        self._owns_ray = False


def _release(actors: list, pgs: list, stop_ray: bool, graceful: bool = True) -> None:
    import ray

    if not ray.is_initialized():
        if stop_ray:  # ray.init interrupted: the processes it started so far
            shutdown_ray()
        return
    if actors:
        try:  # a clean exit where the actor still answers (graceful); killed either way
            if graceful:
                ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors),
                         timeout=5)
        except Exception:
            pass
        kill_actors(actors)
    for pg in pgs:
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(pg)
    pgs.clear()
    if stop_ray:
        shutdown_ray()


def _check_device(device: str) -> None:
    if device.startswith("cuda:"):
        raise ConfigError(f"runtime.device: {device!r} cannot work under Ray: each Ray actor "
                          "sees its GPU as cuda:0; use device: cuda or auto")


def ray_device(cfg: Config, cluster_resources: dict) -> str:
    """The device of every actor, "cuda" or "cpu", decided once on the driver (which may
    have no GPU itself): device auto means CUDA when the cluster has a GPU per worker."""
    dev = cfg.runtime.device
    _check_device(dev)
    gpus, needed = cluster_resources.get("GPU", 0), cfg.parallel.tp * cfg.parallel.pp
    if dev == "auto":
        return "cuda" if gpus >= needed else "cpu"
    if dev.startswith("cuda") and gpus < needed:
        raise ConfigError(f"runtime.device: cuda needs a GPU per worker ({needed}), but the "
                          f"Ray cluster has {gpus:g}; use device: auto or cpu")
    return dev
