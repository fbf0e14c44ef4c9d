"""What a client of the online engine (engine/online.py) holds: a request's stream. No torch.

A `RequestHandle` gets a `Token` for every token the last stage samples for its request,
then one `Finished` with the `RequestOutput` and the request's `RequestTiming`. A
`Watcher` is a client's `on_microbatch`, called for every micro-batch while registered.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pp_runtime.core import driver
from pp_runtime.core.request import RequestOutput


@dataclass(frozen=True)
class RequestTiming:
    queue_s: float | None  # arrival -> its first micro-batch submitted (None: never ran)
    ttft_s: float | None  # arrival -> first token
    generation_s: float | None  # first token -> finish
    bubble_s: float  # pipeline bubble charged to the micro-batches that carried it


@dataclass(frozen=True)
class Token:
    request_id: str
    token_id: int


@dataclass(frozen=True)
class Finished:
    request_id: str
    output: RequestOutput
    timing: RequestTiming
    refused: bool = False  # aborted unrun: max_waiting requests already waited for KV blocks


Event = Token | Finished
Listener = Callable[[Event], None]


class RequestHandle:
    """One request's stream. Events go to `listener` (called on the engine thread: it must
    not block) or, without one, to a queue that `events()` reads. `result()` waits for
    the end."""

    def __init__(self, request_id: str, listener: Listener | None):
        self.request_id = request_id
        self.finished: Finished | None = None
        self._listener = listener
        self._queue: queue.SimpleQueue | None = queue.SimpleQueue() if listener is None else None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Deliver one event; nothing after the first `Finished`."""
        with self._lock:
            if self.finished is not None:
                return
            if isinstance(event, Finished):
                self.finished = event
        try:
            if self._listener is not None:
                self._listener(event)
            else:
                self._queue.put(event)
        finally:
            if isinstance(event, Finished):
                self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Finished:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self.finished

    def events(self) -> Iterator[Event]:
        """Tokens as they come, then the `Finished` (only without a listener)."""
        if self._queue is None:
            raise RuntimeError("this handle delivers its events to a listener")
        while True:
            event = self._queue.get()
            yield event
            if isinstance(event, Finished):
                return


@dataclass(eq=False)
class Watcher:
    """A client's `on_microbatch`, called for every micro-batch while it is registered.
    If it raises, its requests end with `error` and `error` keeps the exception."""

    callback: driver.OnMicroBatch
    request_ids: set[int] = field(default_factory=set)  # its open requests
    error: BaseException | None = None
