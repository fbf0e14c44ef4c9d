"""The Ray executor's stage actors by rank, and the one diagnosis of a fault.

Rank r = stage * tp + tp_rank. Every path to the actors (`ray_transport.py`: a task per
actor, the TP relay, the compiled graph) calls them through `Ranks.call` and names a
fault the same way:
- a dead rank: the first, in rank order, whose `ping` fails (`dead`);
- a hung rank, where the others wait on it or ran ahead: the first that does not answer
  `progress` within PROGRESS_S (stopped, or holding its process), else the one with the
  fewest micro-batches started plus finished, a late one first among equals (`behind`);
- a call that raised (`failure`): its CheckpointError or ConfigError (the user's to fix)
  named as it is; else the first dead rank, where one is (a neighbour's error, gloo's
  "connection reset", may come back first); else, where TP rank 0 failed while a TP peer
  of its stage hangs (its collective timed out), that peer; else the rank itself.
Every fault sets `broken`: the transport and the actors are then torn down without asking
them (a hung or dead rank would hold a graceful stop up).
"""
from __future__ import annotations

import time

from pp_runtime.core.errors import CheckpointError, ConfigError, StartCancelled, WorkerFailed
from pp_runtime.executors.ray_actor import METHOD_GROUPS

PING_S = 5.0  # how long a diagnosis waits for the actors' answers to a ping
PROGRESS_S = 1.0  # ... to `progress`, answered from the control group in milliseconds
CANCEL_POLL_S = 0.2  # how often a start that may be cancelled looks at its event


class Ranks:
    """The actors of one executor in rank order (`actors`: filled by the executor, emptied
    by `kill_actors`), how to call them, and the diagnosis."""

    def __init__(self, ray, tp: int, pp: int, step_s: float):
        self.ray, self.tp, self.pp = ray, tp, pp
        self.step_s = step_s  # runtime.step_timeout_s: what a hung peer is named with
        self.actors: list = []
        self.controlled = False  # the actors have concurrency groups: probes reach a busy rank
        self.cancel = None  # while starting: an Event whose set stops waiting (StartCancelled)
        self.broken = False  # a fault was seen since the actors started

    def call(self, i: int, method: str, *args):
        """`actor.method.remote(*args)` on actor i, as a task named `stage<s>-tp<r>.method`
        (with concurrency groups, in the method's group)."""
        task = f"stage{i // self.tp}-tp{i % self.tp}.{method}"
        group = METHOD_GROUPS.get(method) if self.controlled else None
        return getattr(self.actors[i], method).options(name=task,
                                                      concurrency_group=group).remote(*args)

    def name(self, i: int) -> str:
        return f"stage {i // self.tp} tp rank {i % self.tp}"

    def wait(self, pending: list, deadline: float) -> tuple[list, list]:
        """ray.wait for one of `pending` until `deadline`, in slices while a cancel event is
        held: StartCancelled once it is set."""
        while True:
            left = max(0.0, deadline - time.monotonic())
            step = left if self.cancel is None else min(left, CANCEL_POLL_S)
            ready, rest = self.ray.wait(pending, num_returns=1, timeout=step)
            if ready or step == left:
                return ready, rest
            if self.cancel is not None and self.cancel.is_set():
                raise StartCancelled("the stage workers' start was given up: stopping")

    def gather(self, refs: list, timeout_s: float, what: str,
               setting: str = "runtime.step_timeout_s") -> list:
        """ray.get of one ref per actor (rank order), each fetched once as it comes, failing
        fast on the first error; `setting`: the timeout's name, for the error."""
        pending, deadline = list(refs), time.monotonic() + timeout_s
        index, results = {ref: i for i, ref in enumerate(refs)}, [None] * len(refs)
        while pending:
            ready, pending = self.wait(pending, deadline)
            if not ready:
                raise self.hung(sorted(index[r] for r in pending), timeout_s, what, setting)
            i = index[ready[0]]
            try:
                results[i] = self.ray.get(ready[0])
            except Exception as exc:  # RayActorError (died), RayTaskError (raised)
                raise self.failure(i, exc, what) from exc
        return results

    # ---- the diagnosis -------------------------------------------------------------------
    def hung(self, late: list[int], timeout_s: float, what: str,
             setting: str = "runtime.step_timeout_s") -> WorkerFailed:
        """The error for results of ranks `late` (rank order) that did not come in time."""
        self.broken = True
        return WorkerFailed(f"{self.name(self.behind(late[0], late))} did not finish {what} "
                            f"within {timeout_s:g} s ({setting})")

    def failure(self, i: int | None, exc: BaseException, what: str) -> Exception:
        """The error to raise for rank i's failed call (None: a failure that names no rank,
        a compiled graph's closed channel), by the rule in the module doc."""
        cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
        if i is not None and isinstance(cause, (CheckpointError, ConfigError)):
            return type(cause)(f"{self.name(i)}: {cause}")
        self.broken = True
        seen = f"{type(exc).__name__}: {first_line(exc)}"
        dead = self.dead()
        if dead is not None:
            j, err = dead
            also = "" if j == i or i is None else f" (seen first at {self.name(i)}: {seen})"
            return WorkerFailed(f"{self.name(j)} failed during {what}: "
                                f"{type(err).__name__}: {first_line(err)}{also}")
        if i is None:
            return WorkerFailed(f"the compiled graph failed during {what}: {seen}")
        if i % self.tp == 0 and self.tp > 1:  # TP rank 0's collective timed out on a peer?
            j = self.behind(i, (), range(i, i + self.tp))
            if j != i:
                return self.hung([j], self.step_s, what)
        return WorkerFailed(f"{self.name(i)} failed during {what}: {seen}")

    def dead(self) -> tuple[int, BaseException] | None:
        """(rank, error) of the first actor in rank order whose ping fails within PING_S;
        None if every actor answers or is only slow to (busy is not dead)."""
        refs = [self.call(i, "ping") for i in range(len(self.actors))]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=PING_S)
        for ref in sorted(ready, key=refs.index):
            try:
                self.ray.get(ref)
            except Exception as exc:  # RayActorError / ActorDiedError: the process is gone
                return refs.index(ref), exc
        return None

    def behind(self, first: int, pending=(), ranks=None) -> int:
        """Of `ranks` (default: every rank), the one that hangs: the first that does not
        answer `progress` within PROGRESS_S, else the one with the fewest micro-batches
        started plus finished (a `pending` one, whose result is late, first among equals);
        `first` if none answers at all."""
        ranks = list(range(len(self.actors)) if ranks is None else ranks)
        refs = [self.call(i, "progress") for i in ranks]
        ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=PROGRESS_S)
        done = {}
        for ref in ready:
            try:
                done[ranks[refs.index(ref)]] = self.ray.get(ref)
            except Exception:  # dead: as silent as a stopped one
                pass
        if not done:
            return first
        silent = [i for i in ranks if i not in done]
        if silent:
            return silent[0]
        low = [i for i in ranks if done[i] == min(done.values())]
        return next((i for i in low if i in pending), low[0])

    def ping(self, timeout_s: float) -> bool:
        """Ask every actor for a reply (a liveness probe, from any thread): WorkerFailed
        naming the first that died; False when one is slow to answer (busy: no verdict)."""
        ray, refs = self.ray, [self.call(i, "ping") for i in range(len(self.actors))]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # RayActorError: the actor's process is gone
                self.broken = True
                raise WorkerFailed(f"{self.name(refs.index(ref))} is dead: "
                                   f"{type(exc).__name__}: {first_line(exc)}") from exc
        return len(ready) == len(refs)


def kill_actors(actors: list) -> None:
    """Kill every actor (no restart) and empty the list."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone
            pass
    actors.clear()


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return next((line for line in reversed(text) if line.strip()), type(exc).__name__)[:300]
