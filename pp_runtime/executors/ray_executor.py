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

For every micro-batch the driver submits `execute(mb)` to every actor in rank order, the
`MicroBatch` by value (inlined in each task: cheaper than one `ray.put` at this size).
With `runtime.tp_relay` (opt-in) and tp > 1 it calls TP rank 0 of every stage only (pp
calls), which relays the plan to its TP peers over a gloo control group of the stage
(typed JSON, `executors/control.py`) and returns every TP rank's timing; the peers each
run one long-lived `follow()` call, in a Ray concurrency group of its own
(`executors/ray_relay.py`). With the compiled graph (`runtime.compiled_graph`:
auto, on where every stage has a GPU or a core of its own; docs/distributed.md) every rank's `execute` is joined into one Ray Compiled Graph instead
(`ray.dag`, `experimental_compile`): a micro-batch is one `dag.execute(mb)` that reaches
every actor through the graph's channels. Either way an actor runs its micro-batches in
submission order, so point-to-point pairs always match and up to `in_flight`
micro-batches overlap in the pipeline (activations go between stages over
torch.distributed, not through the graph).
`wait` collects the token ids from TP rank 0 of the last stage and a `StageTiming` from
every rank, in rank order.

Faults: an actor that dies, a call that raises, or a rank that does not finish within
`runtime.step_timeout_s` (or `startup_timeout_s` while starting) raises `WorkerFailed`
naming the stage and rank (with the relay: the driver waits on every `follow()` call with
each micro-batch, so a follower that dies is named at once). A hung rank is told apart
from the ranks that wait on it by `progress`, answered from a concurrency group of its own
(the rank that does not answer, else the one furthest behind); the driver then ends every unfinished request
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

from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.config import Config
from pp_runtime.core.errors import CheckpointError, ConfigError, StartCancelled, WorkerFailed
from pp_runtime.executors.local_ray import shutdown_ray, start_ray
from pp_runtime.executors.ray_actor import METHOD_GROUPS, stage_actor_class
from pp_runtime.executors.ray_graph import CompiledGraphPath, teardown
from pp_runtime.executors.ray_graph import first_line as _first_line
from pp_runtime.executors.ray_relay import RelayPath
from pp_runtime.parallel.groups import DistSpec
from pp_runtime.telemetry.metrics import deployment_tag

CANCEL_POLL_S = 0.2  # how often a start that may be cancelled looks at its event
NAMESPACE = "pp_runtime"  # Ray namespace of every stage actor (`ray list actors` shows it)


class RayExecutor(CompiledGraphPath, RelayPath):
    name = "ray"
    grouped = False  # the relay runs (decided in `_start`)
    controlled = False  # the actors have concurrency groups: probes reach a busy rank

    def __init__(self, cfg: Config, checkpoint: str | Path | None = None,
                 cancel: threading.Event | None = None):
        import ray

        self.cfg, self.ray = cfg, ray
        self._cancel = cancel  # while starting: set = stop waiting (StartCancelled), from any thread
        p, rt = cfg.parallel, cfg.runtime
        self.tp, self.pp = p.tp, p.pp
        _check_device(rt.device)  # before anything starts
        self._owns_ray = not ray.is_initialized()
        self.actors, self._pgs = [], []  # what _release frees
        self.dag, self.dag_broken = None, False  # the compiled graph, once the workers are up
        self.follows, self.relay_broken = {}, False  # the relay (tp > 1, tasks), once up
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
            self._cancel = None

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
        if not self._wait([pg.ready()], time.monotonic() + rt.startup_timeout_s)[0]:
            raise WorkerFailed(f"Ray could not place {self.pp} stages of {bundle} within "
                               f"{rt.startup_timeout_s} s; is the cluster big enough?") from None
        self.graph = self._graph_wanted()  # runtime.compiled_graph; auto: ray_graph.graph_on
        self.grouped = rt.tp_relay and self.tp > 1 and not self.graph  # the relay runs
        # off the graph, probes answer from a concurrency group of their own while a rank
        # waits inside `execute`: a hang is named by progress, not by which result is late
        self.controlled = not self.graph
        self.checkpoint = str(checkpoint) if checkpoint is not None else None
        self._start_workers()

    def _start_workers(self) -> None:
        """One actor per rank on the placement group, the process groups formed, the
        weights loaded, the graph compiled or the relay started (a start and a recovery)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg, rt, pg = self.cfg, self.cfg.runtime, self._pgs[0]
        staged = cfg.with_layer_split_resolved()  # "auto" chosen here once, sent as a list
        gpus = 1 if self.device == "cuda" else 0
        actor_cls = stage_actor_class(self.ray, self.controlled)
        prefix = f"pp-{deployment_tag(cfg)}-{uuid.uuid4().hex[:6]}"  # unique per executor
        self.actor_names = [f"{prefix}-s{s}-tp{r}" for s in range(self.pp) for r in range(self.tp)]
        for i, name in enumerate(self.actor_names):  # rank order
            stage, r = divmod(i, self.tp)
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=stage)
            self.actors.append(actor_cls.options(
                name=name, namespace=NAMESPACE, num_cpus=1, num_gpus=gpus,
                scheduling_strategy=strategy).remote(staged, stage, r, self.checkpoint, self.device))
        local, t0 = rt.ray_address is None, time.monotonic()
        addr, port = self._gather([self._call(0, "rendezvous_address", local)],
                                  rt.startup_timeout_s, "finding a rendezvous address")[0]
        spec = DistSpec(rt.dist_addr or addr, rt.dist_port or port, self.tp, self.pp,
                        self.backend, rt.step_timeout_s)
        t1 = time.monotonic()
        starts = [self._call(i, "start", spec, self.grouped) for i in range(len(self.actors))]
        self.warm_ups = self._gather(starts, rt.startup_timeout_s,
                                     "joining the process group and loading weights")
        t2 = time.monotonic()
        spans = self._gather([self._call(s * self.tp, "layers") for s in range(self.pp)],
                             rt.startup_timeout_s, "reporting its layers")
        ranks = self._gather([self._call(i, "start_times") for i in range(len(self.actors))],
                             rt.startup_timeout_s, "reporting its start")
        self.start_phases = {"actors up": t1 - t0, "start": t2 - t1,  # seconds, slowest rank
                             **{k: max(r[k] for r in ranks) for k in ranks[0]}}
        self.layer_split = [hi - lo for lo, hi in spans]  # what the workers hold (reports)
        if self.graph:
            self.dag = self._compile()
        elif self.grouped:
            self._start_relay()

    def recover(self) -> None:
        """Replace every stage worker after a failure (engine/recovery.py): the actors are
        killed, dead, hung or alive (a process group takes no new member without every
        rank joining again, and a communicator that saw a peer die is not trusted), and
        fresh ones start on the same placement group: new process groups on a new port,
        weights loaded again. Raises as a start does (WorkerFailed, CheckpointError)."""
        dag, self.dag = self.dag, None
        self.relay_broken = True
        self._stop_relay()  # after a fault the followers are killed, not asked
        _kill(self.actors)
        if dag is not None:
            teardown(dag, broken=True)
        self.dag_broken = self.relay_broken = False
        self._start_workers()

    def _call(self, i: int, method: str, *args):
        """`actor.method.remote(*args)` on actor i, as a task named `stage<s>-tp<r>.method`
        (under the relay in the method's concurrency group)."""
        task = f"stage{i // self.tp}-tp{i % self.tp}.{method}"
        group = METHOD_GROUPS.get(method) if self.controlled else None
        return getattr(self.actors[i], method).options(name=task,
                                                      concurrency_group=group).remote(*args)

    # ---- the executor interface --------------------------------------------------------
    @property
    def path(self) -> str:
        """"graph", "relay" or "" (a task per actor): what a calibration is kept under."""
        return "graph" if self.graph else "relay" if self.grouped else ""

    def describe(self) -> str:
        how = ("compiled graph" if self.graph else
               "a task per stage, TP relay" if self.follows else "a task per actor")
        return f"ray ({len(self.actors)} actors, {self.backend}, {how})"

    def submit(self, mb: MicroBatch) -> tuple[int, list]:
        if self.dag is not None:
            try:
                return mb.mb_id, self.dag.execute(mb)  # one ref per rank
            except Exception as exc:  # the graph is broken: a rank died
                raise self._graph_failure(exc, f"micro-batch {mb.mb_id}") from exc
        # by value: Ray inlines an argument under 100 KiB in each task (a plan is ~10 bytes
        # a token), where a `ray.put` cost ~3.5 ms more per micro-batch (docs/distributed.md)
        if self.follows:  # tp > 1: one call per stage, its TP rank 0 relays (ray_relay.py)
            return mb.mb_id, self._submit_relay(mb)
        return mb.mb_id, [self._call(i, "execute", mb) for i in range(len(self.actors))]

    def wait(self, handle: tuple[int, list]) -> SampledTokens:
        mb_id, refs = handle
        what, timeout = f"micro-batch {mb_id}", self.cfg.runtime.step_timeout_s
        if self.follows:  # one (tokens, [timing per TP rank]) per stage
            results = self._gather_relay(refs, timeout, what)
            timings = tuple(t for _, stage in results for t in stage)  # global rank order
            return SampledTokens(mb_id, results[-1][0], timings)
        gather = self._gather_graph if self.dag is not None else self._gather
        results = gather(refs, timeout, what)
        last = (self.pp - 1) * self.tp  # TP rank 0 of the last stage samples
        return SampledTokens(mb_id, results[last][0], tuple(t for _, t in results))

    def ping(self, timeout_s: float) -> bool:
        """Ask every actor for a reply (a liveness probe, from any thread): WorkerFailed
        naming the first that died; False when one is slow to answer (busy: no verdict)."""
        ray, refs = self.ray, [self._call(i, "ping") for i in range(len(self.actors))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # RayActorError: the actor's process is gone
                self.dag_broken = self.relay_broken = True
                raise WorkerFailed(f"{self._name(refs.index(ref))} is dead: "
                                   f"{type(exc).__name__}: {_first_line(exc)}") from exc
        return len(ready) == len(refs)

    def _gather(self, refs: list, timeout_s: float, what: str) -> list:
        """ray.get of one ref per actor (rank order), failing fast on the first error and
        naming the rank that died, raised or hung."""
        ray, pending, deadline = self.ray, list(refs), time.monotonic() + timeout_s
        index, results = {ref: i for i, ref in enumerate(refs)}, [None] * len(refs)
        while pending:
            ready, pending = self._wait(pending, deadline)
            if not ready:
                break
            i = index[ready[0]]
            try:
                results[i] = ray.get(ready[0])  # each result fetched once, as it comes
            except Exception as exc:  # RayActorError (died), RayTaskError (raised)
                raise self._failure(i, exc, what) from exc
        if pending:  # the rank furthest behind (or silent) hangs; the others wait on it
            late = sorted(index[r] for r in pending)
            first = self._behind(late[0], late)
            raise WorkerFailed(f"{self._name(first)} did not finish {what} within {timeout_s:g} s "
                               f"(runtime.step_timeout_s / startup_timeout_s)")
        return results

    def _failure(self, i: int, exc: BaseException, what: str) -> Exception:
        """Rank i's failed call as the error to raise: its CheckpointError or ConfigError
        (the user's to fix) named, anything else as WorkerFailed."""
        cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
        if isinstance(cause, (CheckpointError, ConfigError)):
            return type(cause)(f"{self._name(i)}: {cause}")
        failed = (f"{self._name(i)} failed during {what}: "
                  f"{type(exc).__name__}: {_first_line(exc)}")
        dead = self._dead_rank() if i is not None else None
        if dead is not None and dead != i:  # a neighbour's error came back first
            return WorkerFailed(f"{self._name(dead)} is dead ({failed})")
        return WorkerFailed(failed)

    def _dead_rank(self, timeout_s: float = 2.0) -> int | None:
        """The first rank whose actor is dead (its ping fails at once), if any: the one to
        name when a live neighbour's error came back first (gloo's "connection reset")."""
        refs = [self._call(j, "ping") for j in range(len(self.actors))]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in sorted(ready, key=refs.index):
            try:
                self.ray.get(ref)
            except Exception:
                return refs.index(ref)
        return None

    def _wait(self, pending: list, deadline: float) -> tuple[list, list]:
        """ray.wait for one of `pending` until `deadline`, in slices while a cancel event is
        held: StartCancelled once it is set."""
        while True:
            left = max(0.0, deadline - time.monotonic())
            step = left if self._cancel is None else min(left, CANCEL_POLL_S)
            ready, rest = self.ray.wait(pending, num_returns=1, timeout=step)
            if ready or step == left:
                return ready, rest
            if self._cancel is not None and self._cancel.is_set():
                raise StartCancelled("the stage workers' start was given up: stopping")

    def _name(self, i: int) -> str:
        return f"stage {i // self.tp} tp rank {i % self.tp}"

    def shutdown(self) -> None:
        """Tear the compiled graph down, kill every actor (their process groups go with
        them) and free the placement. After a failure the actors go first: a hung or dead
        rank would hold the graph's teardown up."""
        self._finalizer.detach()
        dag, self.dag = self.dag, None
        if dag is not None and not self.dag_broken:
            teardown(dag)
        graceful = self._stop_relay()  # after a fault the followers are killed, not asked
        _release(self.actors, self._pgs, self._owns_ray, graceful)
        if dag is not None and self.dag_broken:
            teardown(dag, broken=True)
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
        _kill(actors)
    for pg in pgs:
        if pg is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(pg)
    pgs.clear()
    if stop_ray:
        shutdown_ray()


def _kill(actors: list) -> None:
    """Kill every actor (no restart) and empty the list."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass
    actors.clear()


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
