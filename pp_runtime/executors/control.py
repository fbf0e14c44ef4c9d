"""The control channel: typed messages between ranks over a gloo group, never pickles.

A message is its size, then its JSON bytes (`executors/wire.py`): a peer that reached the
unauthenticated rendezvous can send bad data, not code. One rank of the group is its root
(given as a global rank, as torch.distributed takes `src` / `dst`): it `broadcast`s, the
others `recv_broadcast`. The torchrun executor's root is rank 0 of the world; the Ray
executor's relay has one channel per stage, over its TP ranks, rooted at TP rank 0.
Sends never block (isend, async broadcast), so a rank busy with its stage never stalls
another.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pp_runtime.executors import wire

MAX_MESSAGE_BYTES = 1 << 24  # a plan is ~10 bytes per token; a bigger size is not ours


class ControlChannel:
    """Typed messages between ranks over a gloo group: a size, then the JSON bytes.
    `root`: the global rank that broadcasts (a member of `group`)."""

    def __init__(self, group, root: int = 0) -> None:
        self.group, self.root = group, root
        self._pending: list = []  # (work, tensors) of sends not known to be done

    def send(self, value: object, schema: object, dst: int) -> None:
        self._post(value, schema, lambda t: dist.isend(t, dst=dst, group=self.group))

    def broadcast(self, value: object, schema: object) -> None:
        """The root to every other rank of the group at once (one gloo broadcast for the
        size, one for the bytes), asynchronous like `send`: a busy rank takes it when it
        is ready."""
        self._post(value, schema, lambda t: dist.broadcast(t, src=self.root, group=self.group,
                                                           async_op=True))

    def _post(self, value: object, schema: object, start) -> None:
        """The size, then the JSON bytes, each by `start(tensor)` (a send or a broadcast,
        not waited for); the tensors stay referenced until their work is done."""
        payload = torch.frombuffer(bytearray(wire.encode(value, schema)), dtype=torch.uint8)  # [n]
        size = torch.tensor([payload.numel()], dtype=torch.long)
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        for t in (size, payload):
            self._pending.append((start(t), t))

    def recv(self, src: int, schema: object, timeout_s: float | None = None) -> object:
        """The next message from src; with `timeout_s`, each of its two receives raises
        (gloo's "Timed out waiting") past that many seconds: a peer that hangs."""
        if timeout_s is None:
            return self._receive(src, schema, lambda t: dist.recv(t, src=src, group=self.group))
        limit = timedelta(seconds=timeout_s)
        return self._receive(src, schema, lambda t: dist.irecv(t, src=src, group=self.group)
                             .wait(timeout=limit))

    def recv_broadcast(self, schema: object) -> object:
        """The next message `broadcast` by the root."""
        return self._receive(self.root, schema,
                             lambda t: dist.broadcast(t, src=self.root, group=self.group))

    @staticmethod
    def _receive(src: int, schema: object, take) -> object:
        size = torch.empty(1, dtype=torch.long)
        take(size)
        n = int(size.item())
        if not 0 < n <= MAX_MESSAGE_BYTES:
            raise wire.WireError(f"control message of {n} bytes from rank {src}")
        payload = torch.empty(n, dtype=torch.uint8)
        take(payload)
        return wire.decode(payload.numpy().tobytes(), schema)

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []
