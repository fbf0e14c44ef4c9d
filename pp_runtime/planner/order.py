"""The order in which `uniform` admits arrived requests when no latency target is set.

With no target the planner runs for the makespan (the time to finish what it was given).
Once the KV pages are full, the work left is a set of requests each of which needs one
round through the pipeline per token it still makes, however many rows run beside it: a
request with L tokens to make admitted at t ends no earlier than t + L rounds. FCFS admits
the longest requests whenever they happen to arrive; the last of them then decode alone at
the end (GPT-3 175B, P:D 1, every request at once: the last third of the run is the decode
tail of the longest requests, with fewer and fewer rows). So the arrived queue goes in
least-slack order: by

    arrival_s - rounds x round_s

(rounds: the tokens a request is expected to make, plus its prompt's chunks at the knee
over the micro-batches of a round, as chunks follow each other in flight; round_s: one
round of micro-batches at the knee). For requests that arrive together that is longest first,
the classic rule for the makespan of independent jobs (LPT); a request that arrived earlier
is passed only by one whose extra rounds outweigh its later arrival, so no request waits
for ever behind a stream of longer ones. Requests that already made progress (preempted, or
taken over in a recovery) stay first, as every planner keeps them. With a TBT or TTFT
target, the queue stays first come first served: there the order is what the time to first
token is measured on.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from pp_runtime.core.request import Request


class SlackOrder:
    """Keeps the arrived part of a planner's `waiting` deque in least-slack order.

    `add` sees every request as the planner takes it (in arrival order); `order(now)`
    re-sorts the arrived part only when a request arrived since the last call, so a run
    of 10^4 micro-batches sorts once per arrival, not once per micro-batch."""

    def __init__(self, waiting: deque[Request], rounds: Callable[[Request], float],
                 round_s: float):
        self.waiting, self.rounds, self.round_s = waiting, rounds, round_s
        self.incoming: deque[Request] = deque()  # added, not yet seen arrived

    def add(self, req: Request) -> None:
        self.incoming.append(req)

    def key(self, req: Request) -> float:
        return req.arrival_s - self.rounds(req) * self.round_s

    def order(self, now: float) -> None:
        incoming = self.incoming
        if not incoming or incoming[0].arrival_s > now:
            return
        while incoming and incoming[0].arrival_s <= now:
            incoming.popleft()
        waiting = self.waiting
        arrived = len(waiting) - len(incoming)  # the rest have not arrived yet
        if arrived <= 0 or waiting[arrived - 1].arrival_s > now:  # one left `waiting` early
            arrived = next((i for i, r in enumerate(waiting) if r.arrival_s > now), len(waiting))
        head = [waiting.popleft() for _ in range(arrived)]
        started = [r for r in head if r.num_preemptions or r.output_token_ids]
        fresh = sorted((r for r in head if not (r.num_preemptions or r.output_token_ids)),
                       key=self.key)  # stable: equal keys keep their arrival order
        waiting.extendleft(reversed(started + fresh))

