"""How the Ray executor reaches its stage actors: one `Transport`, chosen once (`choose`).

Three implementations, each holding its own state, all reaching the actors through
`Ranks` and naming a fault by its one diagnosis (`ray_ranks.py`):
- `TaskPath` (here): one `execute(mb)` task per actor, in rank order;
- `RelayPath` (`ray_relay.py`, `runtime.tp_relay` with tp > 1): one task per stage, to
  its TP rank 0, which relays the plan to its TP peers over the stage's control group;
- `GraphPath` (`ray_graph.py`, `runtime.compiled_graph`): every rank's `execute` joined
  into one Ray Compiled Graph, one `dag.execute(mb)` per micro-batch.
The executor starts the actors, then `start()`s the transport (after a recovery too);
`submit` / `gather` carry a micro-batch; `teardown(broken)` comes before the actors are
killed, and says whether they may still be asked to stop.
"""
from __future__ import annotations

from typing import Protocol

from pp_runtime.core.batch import MicroBatch, RankResult
from pp_runtime.executors.ray_graph import GraphPath
from pp_runtime.executors.ray_ranks import Ranks
from pp_runtime.executors.ray_relay import RelayPath


class Transport(Protocol):
    path: str  # "" (a task per actor), "relay" or "graph": what a calibration is kept under
    how: str  # the executor's describe() says it
    concurrency_groups: bool  # the actors answer probes from a group of their own
    relay: bool  # every actor joins its stage's control channel at start

    def start(self) -> None: ...  # once the actors are up: compile, start the follow loops
    def submit(self, mb: MicroBatch) -> object: ...
    def gather(self, handle: object, timeout_s: float, what: str) -> list[RankResult]: ...
    def teardown(self, broken: bool) -> bool: ...  # True: the actors may be asked to stop


class TaskPath:
    """One `execute(mb)` per actor, the plan by value: Ray inlines an argument under
    100 KiB in each task (a plan is ~10 bytes a token), where a `ray.put` cost ~3.5 ms more
    per micro-batch (docs/distributed.md)."""

    path, how, concurrency_groups, relay = "", "a task per actor", True, False

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    def start(self) -> None:
        pass

    def submit(self, mb: MicroBatch) -> list:
        return [self.ranks.call(i, "execute", mb) for i in range(len(self.ranks.actors))]

    def gather(self, refs: list, timeout_s: float, what: str) -> list[RankResult]:
        return self.ranks.gather(refs, timeout_s, what)

    def teardown(self, broken: bool) -> bool:
        return not broken


def choose(ranks: Ranks, cfg, graph: bool) -> Transport:
    """The compiled graph where `graph` (`ray_graph.graph_on`), else the relay where asked
    for and tp > 1, else a task per actor."""
    if graph:
        return GraphPath(ranks, cfg.in_flight + 1, cfg.runtime.step_timeout_s)
    if cfg.runtime.tp_relay and ranks.tp > 1:
        return RelayPath(ranks)
    return TaskPath(ranks)
