"""The Ray executor's relay (tasks path, tp > 1): one call per stage per micro-batch.

The driver calls `execute(mb)` on TP rank 0 of each stage only (pp calls, not tp * pp).
That rank hands the plan on to its TP peers over the stage's control channel (a gloo group
of the stage's TP ranks, `parallel/groups.stage_control_group`; typed JSON messages,
`executors/control.py`, never pickles), runs its own part, takes each peer's `StageTiming`
back over the same channel and returns the `RankResult` of each of the stage's TP ranks,
in TP order. Every other TP rank runs one long-lived `follow()` call, started once after the
workers are up, in a concurrency group of its own (`ping`, `progress` and `sleep` answer
from another, so the liveness probe and the fault diagnosis reach a busy follower):
receive a plan, execute it, send the timing back, until a None plan.

Faults keep their names. The driver holds every `follow()` ref and waits on them with the
stage calls of every micro-batch: a follower that dies or raises ends its follow call
with an error, named at once (not after `runtime.step_timeout_s`). A follower that hangs
leaves its TP rank 0 blocked in a TP collective or on its timing; after the step timeout
the rank that is furthest behind (`StageActor.progress`: micro-batches started and
finished) is named, by the executor's one diagnosis (`ray_ranks.py`). `RelayMember` is
the actors' side, mixed into `StageActor`; `RelayPath` the driver's, one of the Ray
executor's three `Transport`s (`ray_transport.py`).
"""
from __future__ import annotations

import time

from pp_runtime.core.errors import WorkerFailed

STOP_S = 5.0  # how long a healthy shutdown waits for the follow loops to end
IDLE_S = 365 * 86400.0  # a follower waits for its next plan as long as the deployment idles


class RelayMember:
    """The relay's part of `StageActor` (which holds `cfg`, `stage`, `relay`, `following`
    and `_run`): TP rank 0 leads its stage, the others follow."""

    def join_relay(self, spec, rank: int) -> None:
        """The stage's control channel, rooted at its TP rank 0 (a global rank); every rank
        calls this after `init_distributed`, creating every stage's group, in order."""
        from pp_runtime.executors.control import ControlChannel
        from pp_runtime.parallel.groups import stage_control_group

        group = stage_control_group(spec.tp, spec.pp, rank, IDLE_S)
        self.relay = ControlChannel(group, root=self.stage * spec.tp)

    def lead(self, mb):
        """TP rank 0's `execute`: the plan to its TP peers first, then its own part; returns
        the `RankResult` of every TP rank of the stage, in TP order."""
        from pp_runtime.executors import wire

        self.relay.broadcast(mb, wire.PLAN)
        own = self._run(mb)
        peers = range(self.relay.root + 1, self.relay.root + self.cfg.parallel.tp)
        return [own] + [self.relay.recv(r, wire.RESULT) for r in peers]

    def follow(self) -> int:
        """A TP rank other than 0 under the relay, for as long as the deployment runs (its
        own concurrency group): take each plan from TP rank 0, execute it, send the timing
        back; returns how many it ran when a None plan comes."""
        from pp_runtime.executors import wire

        self.following, n = True, 0
        try:
            while (mb := self.relay.recv_broadcast(wire.PLAN)) is not None:
                self.relay.send(self._run(mb), wire.RESULT, self.relay.root)
                n += 1
            self.relay.flush()
        finally:
            self.following = False
        return n

    def stop_following(self) -> None:
        """TP rank 0 under the relay: a None plan, after every plan before it, ends the
        follow loops of its stage."""
        from pp_runtime.executors import wire

        self.relay.broadcast(None, wire.PLAN)
        self.relay.flush()


class RelayPath:
    """The relay as a `Transport` (`ray_transport.py`): `follows` maps each follow()
    ref to its rank while the relay runs (every TP rank but 0)."""

    path, how, concurrency_groups, relay = "relay", "a task per stage, TP relay", True, True

    def __init__(self, ranks):
        self.ranks, self.follows = ranks, {}

    def start(self) -> None:
        """Start the follow loop of every TP rank other than 0 (after `start`)."""
        r = self.ranks
        self.follows = {r.call(i, "follow"): i for i in range(len(r.actors)) if i % r.tp}

    def submit(self, mb) -> list:
        """One `execute(mb)` per stage, to its TP rank 0 (by value, as for every actor)."""
        r = self.ranks
        return [r.call(s * r.tp, "execute", mb) for s in range(r.pp)]

    def gather(self, refs: list, timeout_s: float, what: str) -> list:
        """Every rank's result in rank order (each stage's TP rank 0 brings its peers'),
        watching every follow call meanwhile; the first fault raises, named."""
        r, deadline = self.ranks, time.monotonic() + timeout_s
        rank = {ref: s * r.tp for s, ref in enumerate(refs)}
        results, pending = {}, list(refs) + list(self.follows)
        while len(results) < len(refs):
            ready, pending = r.wait(pending, deadline)
            if not ready:  # the step timeout: the rank furthest behind hangs
                raise r.hung(sorted(rank[ref] for ref in pending if ref in rank), timeout_s, what)
            ref = ready[0]
            i = rank[ref] if ref in rank else self.follows[ref]
            try:
                value = r.ray.get(ref)
            except Exception as exc:  # died or raised: which rank caused it?
                raise r.failure(i, exc, what) from exc
            if ref not in rank:  # a follow call that returned: it stopped following
                r.broken = True
                raise WorkerFailed(f"{r.name(i)} stopped following its TP rank 0 during {what}")
            results[i // r.tp] = value
        return [result for s in range(r.pp) for result in results[s]]

    def teardown(self, broken: bool) -> bool:
        """End the follow loops: while healthy, each stage's TP rank 0 sends a None plan
        (after the micro-batches already submitted) and every follow call returns. False
        when that was not possible, or `broken`: the caller kills the actors instead."""
        follows, self.follows = self.follows, {}
        if broken or not follows:
            return not broken
        r = self.ranks
        try:
            r.ray.get([r.call(s * r.tp, "stop_following") for s in range(r.pp)], timeout=STOP_S)
            ready, _ = r.ray.wait(list(follows), num_returns=len(follows), timeout=STOP_S)
            r.ray.get(ready)
        except Exception:
            return False
        return len(ready) == len(follows)
