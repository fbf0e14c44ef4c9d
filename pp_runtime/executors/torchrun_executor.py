"""The torchrun executor: one stage worker per torchrun process; rank 0 also drives.

Rank r = stage * tp + tp_rank, as for Ray. Rank 0 (stage 0, TP rank 0) runs the planner and
the driver loop. `submit(mb)` broadcasts the plan to every other rank over a gloo CPU group (the
control channel, also with NCCL for the activations: one asynchronous broadcast, not
world - 1 sends) and then runs rank 0's own stage-0 work; the other ranks (`serve`) take plans in order, execute them, and send back
`(token ids or None, StageTiming)`. `wait(mb)` collects those in rank order. The control
channel (`executors/control.py`, rooted at rank 0) never blocks a send (isend, async
broadcast), so a rank busy with its stage never stalls another. Messages are JSON typed by
the dataclasses (`executors/wire.py`), never pickles.

A rank that dies takes the job down through torchrun's agent; a rank that hangs makes the
others fail after the process group's timeout (`runtime.step_timeout_s`).
"""
from __future__ import annotations

import torch.distributed as dist

from pp_runtime.executors import wire
from pp_runtime.executors.control import ControlChannel
from pp_runtime.core.batch import MicroBatch, SampledTokens
from pp_runtime.worker.stage import StageWorker


def _result(worker: StageWorker, out) -> object:
    return out.tokens if isinstance(out, SampledTokens) and worker.tp_rank == 0 else None


class TorchrunExecutor:
    """Rank 0's executor: the driver's `submit` / `wait` over the control channel."""

    name = "torchrun"

    def __init__(self, worker: StageWorker, ctrl: ControlChannel, world_size: int, tp: int):
        self.worker, self.ctrl, self.world, self.tp = worker, ctrl, world_size, tp
        self.last = world_size - tp  # TP rank 0 of the last stage: it samples
        self._own: dict[int, tuple] = {}  # mb id -> rank 0's (tokens, timing)
        self.device = worker.device  # what the stages run on (reports name it)

    def describe(self) -> str:
        return f"torchrun ({self.world} ranks, {dist.get_backend()})"

    def submit(self, mb: MicroBatch) -> int:
        self.ctrl.broadcast(mb, wire.PLAN)  # one message to every rank, not world - 1
        out, timing = self.worker.execute(mb)
        self._own[mb.mb_id] = (_result(self.worker, out), timing)
        return mb.mb_id

    def wait(self, mb_id: int) -> SampledTokens:
        results = [self._own.pop(mb_id)] + [self.ctrl.recv(r, wire.RESULT)
                                          for r in range(1, self.world)]
        return SampledTokens(mb_id, results[self.last][0], tuple(t for _, t in results))

    def shutdown(self) -> None:
        """Tell every other rank to stop (they leave `serve`)."""
        if self.world:
            self.ctrl.broadcast(None, wire.PLAN)
            self.ctrl.flush()
            self.world = 0


def serve(worker: StageWorker, ctrl: ControlChannel) -> int:
    """A rank other than 0: execute plans from rank 0 in order until told to stop;
    returns how many micro-batches it ran."""
    n = 0
    while (mb := ctrl.recv_broadcast(wire.PLAN)) is not None:
        out, timing = worker.execute(mb)
        ctrl.send((_result(worker, out), timing), wire.RESULT, 0)
        n += 1
    if worker.link is not None:
        worker.link.flush()
    ctrl.flush()
    return n
