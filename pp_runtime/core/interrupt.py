"""Ctrl-C and SIGTERM end a run the same way: as a KeyboardInterrupt.

`handled()` (the CLI runs every command in it) makes SIGINT and SIGTERM raise `Interrupted`,
a KeyboardInterrupt that names its signal. The path of an interrupted run:

1. the driver loop ends every unfinished request with finish reason `error` and re-raises;
2. whoever started the run attaches what it has to the exception: `exc.outputs` (from
   `LLM.generate`, as ExecutorFailed does) or `exc.result`, a `RunResult` marked
   `interrupted_by` (from `run_workload` and `simulate`), and shuts its executor down
   (Ray actors killed, placement group removed, a local Ray stopped);
3. the CLI writes that as the partial report (`"partial": true` in report.json) and exits
   `exit_code(exc)`: 128 + the signal number, 130 for SIGINT and 143 for SIGTERM.

A signal while an interrupt is being handled (the teardown: a few seconds) is ignored.
Python runs a signal handler between any two bytecodes, and an exception raised in some
places (a fork hook, `__del__`) is printed and dropped: `deferred()` holds the signals
while such code runs (Ray's start-up forks its processes), and a dropped interrupt does
not count as being handled, so the next signal raises again. `ray.init` also replaces the
process's SIGTERM handler (its core worker then aborts with a C++ stack dump); `deferred()`
puts the caller's back.
"""
from __future__ import annotations

import signal
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; `str(exc)` is "interrupted by SIGINT"."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def signal_name(exc: KeyboardInterrupt) -> str:
    """SIGINT or SIGTERM: the signal behind an interrupt (a plain KeyboardInterrupt is SIGINT)."""
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


def exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


def reason(exc: KeyboardInterrupt) -> str:
    """What an interrupted request's output says (`RequestOutput.error`)."""
    return f"interrupted by {signal_name(exc)}"


@contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` inside the block (in the main thread; no-op
    elsewhere); the previous handlers come back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[weakref.ref] = []  # the Interrupted raised last, while something holds it

    def on_signal(signum: int, frame) -> None:
        if raised and raised[0]() is not None:  # being handled: let the teardown finish
            print(f"pp-runtime: {signal.Signals(signum).name} while stopping: ignored, "
                  "the run is shutting down (a few seconds)", file=sys.stderr, flush=True)
            return
        exc = Interrupted(signum)
        raised[:] = [weakref.ref(exc)]
        try:
            raise exc
        finally:
            del exc  # no cycle through this frame: the exception goes with its last holder

    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held until the block ends, then handled as they would have been
    (raised, for `handled()`): for code an exception must not cut in half, such as
    `ray.init`. The handlers in place before the block are in place after it, and a
    SIGTERM handler the block installed that exits (ray.init's: `sys.exit(15)`) counts as
    a SIGTERM held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in SIGNALS}
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        held.append(signal.SIGTERM)
        _restore(previous)
        _deliver(held[0], previous[held[0]])
        raise  # the handler did not stop the process (SIG_IGN): the block did not finish
    _restore(previous)
    if held:
        _deliver(held[0], previous[held[0]])


def _restore(handlers: dict) -> None:
    for s, handler in handlers.items():
        signal.signal(s, handler)


def _deliver(signum: int, handler) -> None:
    """What the signal would have done under `handler` (raise, or end the process)."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
