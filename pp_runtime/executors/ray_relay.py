"""The Ray executor's relay (tasks path, tp > 1): one call per stage per micro-batch.

The driver calls `execute(mb)` on TP rank 0 of each stage only (pp calls, not tp * pp).
That rank hands the plan on to its TP peers over the stage's control channel (a gloo group
of the stage's TP ranks, `parallel/groups.stage_control_group`; typed JSON messages,
`executors/control.py`, never pickles), runs its own part, takes each peer's `StageTiming`
back over the same channel and returns `(tokens, timings of the stage's TP ranks in TP
order)`. Every other TP rank runs one long-lived `follow()` call, started once after the
workers are up, in a concurrency group of its own (`ping`, `progress` and `sleep` answer
from another, so the liveness probe and the fault diagnosis reach a busy follower):
receive a plan, execute it, send the timing back, until a None plan.

Faults keep their names. The driver holds every `follow()` ref and waits on them with the
stage calls of every micro-batch: a follower that dies or raises ends its follow call
with an error, named at once (not after `runtime.step_timeout_s`). A follower that hangs
leaves its TP rank 0 blocked in a TP collective or on its timing; after the step timeout
the rank that is furthest behind (`StageActor.progress`: micro-batches started and
finished) is named. `RelayMember` is the actors' side, mixed into `StageActor`;
`RelayPath` the driver's, mixed into `RayExecutor`, which holds `actors`, `tp`, `pp`,
`ray`, `_call`, `_name`, `_wait`, `_failure` and `_behind`.
"""
from __future__ import annotations

import time

from pp_runtime.core.errors import WorkerFailed
from pp_runtime.executors.ray_graph import PING_S, first_line

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
        (tokens, the timings of every TP rank of the stage in TP order)."""
        from pp_runtime.executors import wire

        self.relay.broadcast(mb, wire.PLAN)
        tokens, timing = self._run(mb)
        peers = range(self.relay.root + 1, self.relay.root + self.cfg.parallel.tp)
        return tokens, [timing] + [self.relay.recv(r, wire.RESULT)[1] for r in peers]

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
    follows: dict  # follow() ref -> actor index: every TP rank but 0, while the relay runs
    relay_broken: bool  # a fault was seen: shutdown kills the followers instead of stopping them

    def _start_relay(self) -> None:
        """Start the follow loop of every TP rank other than 0 (once, after `start`)."""
        self.follows = {self._call(i, "follow"): i
                        for i in range(len(self.actors)) if i % self.tp}

    def _submit_relay(self, mb) -> list:
        """One `execute(mb)` per stage, to its TP rank 0 (by value, as for every actor)."""
        return [self._call(s * self.tp, "execute", mb) for s in range(self.pp)]

    def _gather_relay(self, refs: list, timeout_s: float, what: str) -> list:
        """Each stage's `(tokens, timings)` in stage order, watching every follow call
        meanwhile; the first fault raises WorkerFailed naming its rank."""
        ray, deadline = self.ray, time.monotonic() + timeout_s
        rank = {ref: s * self.tp for s, ref in enumerate(refs)}
        results, pending = {}, list(refs) + list(self.follows)
        while len(results) < len(refs):
            ready, pending = self._wait(pending, deadline)
            if not ready:  # the step timeout: the rank furthest behind hangs
                late = sorted(rank[r] for r in pending if r in rank)
                raise self._hung(self._behind(late[0], late), timeout_s, what)
            ref = ready[0]
            i = rank[ref] if ref in rank else self.follows[ref]
            try:
                value = ray.get(ref)
            except Exception as exc:  # died or raised: which rank caused it?
                raise self._relay_failure(i, exc, what) from exc
            if ref not in rank:  # a follow call that returned: it stopped following
                self.relay_broken = True
                raise WorkerFailed(f"{self._name(i)} stopped following its TP rank 0 "
                                   f"during {what}")
            results[i // self.tp] = value
        return [results[s] for s in range(self.pp)]

    def _hung(self, i: int, timeout_s: float, what: str) -> WorkerFailed:
        self.relay_broken = True
        return WorkerFailed(f"{self._name(i)} did not finish {what} within {timeout_s:g} s "
                            f"(runtime.step_timeout_s)")

    def _relay_failure(self, i: int, exc: BaseException, what: str) -> Exception:
        """The error for a failed call of rank i: the first rank that died, if any (a
        follower's death also fails its TP rank 0, and the reverse); else, where TP rank 0
        failed while a peer of its stage is behind it (a hang that timed its collective
        out), that peer; else rank i's own error."""
        self.relay_broken = True
        dead = self._first_dead()
        if dead is not None:
            j, err = dead
            return WorkerFailed(f"{self._name(j)} failed during {what}: "
                                f"{type(err).__name__}: {first_line(err)}")
        if i % self.tp == 0:
            done = self._progress(range(i, i + self.tp))
            if done and min(done) < done[0]:
                return self._hung(i + done.index(min(done)), self.cfg.runtime.step_timeout_s,
                                  what)
        return self._failure(i, exc, what)

    def _first_dead(self) -> tuple[int, BaseException] | None:
        """(rank, error) of the first actor in rank order whose ping fails; None if every
        actor answers or is only slow to (busy is not dead)."""
        from ray.exceptions import GetTimeoutError

        refs = [self._call(i, "ping") for i in range(len(self.actors))]
        for i, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=PING_S)
            except GetTimeoutError:
                continue
            except Exception as exc:  # RayActorError / ActorDiedError
                return i, exc
        return None

    def _progress(self, ranks) -> list[int]:
        """Each rank's progress count, [] if one does not answer."""
        try:
            return self.ray.get([self._call(i, "progress") for i in ranks], timeout=PING_S)
        except Exception:
            return []

    def _stop_relay(self) -> bool:
        """End the follow loops: while healthy, each stage's TP rank 0 sends a None plan
        (after the micro-batches already submitted) and every follow call returns. False
        when that was not possible: the caller kills the actors instead."""
        follows, self.follows = self.follows, {}
        if not follows:
            return not self.relay_broken
        if self.relay_broken:
            return False
        ray = self.ray
        try:
            ray.get([self._call(s * self.tp, "stop_following") for s in range(self.pp)],
                    timeout=STOP_S)
            ready, _ = ray.wait(list(follows), num_returns=len(follows), timeout=STOP_S)
            ray.get(ready)
        except Exception:
            return False
        return len(ready) == len(follows)
