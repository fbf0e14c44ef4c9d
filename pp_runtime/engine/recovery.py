"""Recovery in place: the budget, the record of each recovery, the stage a failure names.

A stage worker that dies or hangs fails the executor's `submit` or `wait`; the engine
(`engine/online.py`) then asks the executor to `recover()` (Ray: every stage actor
replaced on the same placement group, the process groups formed again, the weights
loaded again) and hands every unfinished request to a fresh planner, where each computes
its prompt and the tokens it already produced again (`Planner.adopt`). The budget bounds
it: at most `runtime.recovery_attempts` recoveries, failed ones included, in any
`runtime.recovery_window_s`; past it the failure ends every open request as before. No torch.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import asdict, dataclass

_NAMED = re.compile(r"stage (\d+) tp rank (\d+)")


@dataclass(frozen=True)
class Recovery:
    """One recovery, as the report lists it (times on the engine clock)."""

    at_s: float  # when the failure was seen
    stage: int | None  # the stage the failure named (None: not named)
    tp_rank: int | None
    cause: str  # the failure's first line
    seconds: float  # failure seen -> the pipeline took micro-batches again
    attempts: int  # tries it took (a replacement that failed to start counts)
    requests: int  # requests computed again
    tokens: int  # tokens they had computed, computed again

    def as_dict(self) -> dict:
        return asdict(self)


class Budget:
    """At most `attempts` recovery attempts in any `window_s` seconds."""

    def __init__(self, attempts: int, window_s: float):
        self.attempts, self.window_s = attempts, window_s
        self._times: deque[float] = deque()

    def take(self, now: float) -> bool:
        """Spend one attempt at `now`; False (nothing spent) when the window holds all."""
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()
        if len(self._times) >= self.attempts:
            return False
        self._times.append(now)
        return True


def named_rank(exc: BaseException | None) -> tuple[int | None, int | None]:
    """(stage, tp rank) a failure names, searching its causes ("stage 1 tp rank 0 ...")."""
    while exc is not None:
        m = _NAMED.search(str(exc))
        if m:
            return int(m.group(1)), int(m.group(2))
        exc = exc.__cause__
    return None, None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
