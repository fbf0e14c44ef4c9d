"""One way to time a stage's work, on CPU and GPU: spans as context managers, names as an enum.

    rec = timer.record()                 # the spans of one call
    with rec.span(Op.COMPUTE):
        ...
    spans = rec.resolve()                # {Op: (start_s, end_s)} on this process's clock

`device_timer(device)` picks the implementation; callers never branch on the device.

- CPU (`HostTimer`): `time.perf_counter()` at each edge of a span.
- CUDA (`CudaEventTimer`): a CUDA event recorded on the device's current stream at each
  edge. Recording never waits, so kernels keep queueing ahead. An event's time is when the
  *stream* reached it: a span covers the GPU running the work inside it, or the GPU being
  held by a wait NCCL put on the stream (a receive, a send's `work.wait()`).
  `resolve()` waits for this call's events only (`event.synchronize()`: this stream up
  to its last span, not the device, so sends still running on NCCL's own streams are not
  waited for). It then places each event on the host clock: the timer holds an anchor, an
  event with a known `perf_counter` time, and an event's time is
  `anchor_s + anchor.elapsed_time(event) / 1000`. The first anchor is recorded once, on an
  idle stream, when the timer is made. After each resolve the call's last event becomes the
  anchor. `elapsed_time` is a float32 count of milliseconds, precise to about 1 µs only
  over intervals shorter than about 10 s: from one fixed anchor, the gaps between calls
  (the bubbles) would be off by a millisecond after a few hours. With the moving anchor,
  a span's duration (`start.elapsed_time(end)`) and the gap since the previous call are
  exact to the GPU timer's resolution; the rounding only makes the clock as a whole run
  off by at most 2**-24 of the elapsed time (< 1 ms in 4 hours), less than two crystals drift.

Times on the two paths mean the same thing for the bubble accounting (`docs/bubbles.md`):
one monotonic clock per process, comparable across that process's calls. On CUDA it runs
at the GPU timer's rate, which drifts from the host's by parts per million at most.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from enum import Enum
from typing import Any, Callable, Iterator, Protocol

import torch


class Op(str, Enum):
    """What a stage call spends time on, in the order a call runs them (`StageTiming`)."""

    RECV_WAIT = "recv_wait"  # until the previous stage's header arrived: its wait_s
    TRANSFER = "transfer"  # header to gathered activations: transfer_s
    COMPUTE = "compute"  # the stage's layers (and logits + sampling on the last stage)
    SEND_WAIT = "send_wait"  # until the next stage took the previous send: send_wait_s


class Spans(dict):
    """Op -> (start_s, end_s) on the process's clock, for the spans a call recorded."""

    def seconds(self, op: Op) -> float:
        """The span's duration; 0.0 when the call did not record it (stage 0 receives nothing)."""
        start, end = self.get(op, (0.0, 0.0))
        return end - start


class SpanRecord:
    """The spans of one call. `mark()` takes one time stamp (a clock reading or a recorded
    event); `place(pairs)` turns (start mark, end mark) pairs into seconds."""

    def __init__(self, mark: Callable[[], Any],
                 place: Callable[[list[tuple[Any, Any]]], list[tuple[float, float]]]):
        self._mark, self._place = mark, place
        self._marks: dict[Op, tuple[Any, Any]] = {}  # in the order the spans ended

    @contextmanager
    def span(self, op: Op) -> Iterator[None]:
        """Time the body as `op`. A body that raises records nothing (the call failed)."""
        start = self._mark()
        yield
        end = self._mark()
        if op in self._marks:
            raise ValueError(f"timer: {op.name} recorded twice in one call")
        self._marks[op] = (start, end)

    def resolve(self) -> Spans:
        """Every span in seconds (on CUDA: once their events have happened)."""
        return Spans(zip(self._marks, self._place(list(self._marks.values()))))


class Timer(Protocol):
    def record(self) -> SpanRecord: ...


class HostTimer:
    """Spans on the host clock: what the CPU path measures (gloo waits block the host)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock

    def record(self) -> SpanRecord:
        return SpanRecord(self.clock, list)


class CudaEventTimer:
    """Spans as events on one CUDA stream, placed on the host clock through a moving anchor.

    `mark()` creates an event and records it now; `anchor` is an event that has happened
    at host time `anchor_s`. Build it with `cuda_timer(device)`; tests pass fake events.
    """

    def __init__(self, mark: Callable[[], Any], anchor: Any, anchor_s: float):
        self.mark, self.anchor, self.anchor_s = mark, anchor, anchor_s

    def record(self) -> SpanRecord:
        return SpanRecord(self.mark, self.place)

    def place(self, pairs: list[tuple[Any, Any]]) -> list[tuple[float, float]]:
        """Wait for the spans' end events, then each span in seconds on the host clock;
        the last end event becomes the anchor."""
        if not pairs:
            return []
        for _, end in pairs:  # on one stream the last implies the rest; the others return at once
            end.synchronize()
        placed = []
        for start, end in pairs:
            start_s = self.anchor_s + self.anchor.elapsed_time(start) / 1e3
            placed.append((start_s, start_s + start.elapsed_time(end) / 1e3))
        last = max(range(len(pairs)), key=lambda i: placed[i][1])
        self.anchor, self.anchor_s = pairs[last][1], placed[last][1]
        return placed


def cuda_timer(device: torch.device) -> CudaEventTimer:
    """A `CudaEventTimer` on `device`'s current stream. Synchronizes the device once, so the
    anchor event runs as soon as it is recorded and its host time is known."""

    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    torch.cuda.synchronize(device)
    anchor = mark()
    anchor.synchronize()
    return CudaEventTimer(mark, anchor, time.perf_counter())


def device_timer(device: torch.device) -> Timer:
    """The timer for work on `device`: CUDA events on a GPU, perf_counter on the CPU."""
    return cuda_timer(device) if device.type == "cuda" else HostTimer()
