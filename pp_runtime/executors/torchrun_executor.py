"""The torchrun executor: one stage worker per torchrun process; rank 0 also drives.

Rank r = stage * tp + tp_rank, as for Ray. Rank 0 (stage 0, TP rank 0) runs the planner and
the driver loop. `submit(mb)` broadcasts the plan to every other rank over a gloo CPU group (the
control channel, also with NCCL for the activations: one asynchronous broadcast, not
world - 1 sends) and hands rank 0's own stage-0 work to a thread of its own, so the driver
plans the next micro-batch while stage 0 computes this one (the thread takes them in
order; torch releases the GIL while it computes). The other ranks (`serve`) take plans in
order, execute them, and send back `(token ids or None, StageTiming)`. `wait(mb)` collects
those in rank order, rank 0's from its thread. The control channel (`executors/control.py`,
rooted at rank 0) never blocks a send (isend, async broadcast), so a rank busy with its
stage never stalls another. Messages are JSON typed by the dataclasses
(`executors/wire.py`), never pickles.

A rank that dies takes the job down through torchrun's agent; a rank that hangs makes the
others fail after the process group's timeout (`runtime.step_timeout_s`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

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
    path = ""  # one way to reach the stages (driver.Executor)

    def __init__(self, worker: StageWorker, ctrl: ControlChannel, world_size: int, tp: int):
        self.worker, self.ctrl, self.world, self.tp = worker, ctrl, world_size, tp
        self.last = world_size - tp  # TP rank 0 of the last stage: it samples
        # rank 0's stage-0 work, in submission order, off the driver's thread
        self._stage0 = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage0")
        self.device = worker.device  # what the stages run on (reports name it)

    def describe(self) -> str:
        return f"torchrun ({self.world} ranks, {dist.get_backend()})"

    def submit(self, mb: MicroBatch) -> tuple[int, Future]:
        self.ctrl.broadcast(mb, wire.PLAN)  # one message to every rank, not world - 1
        return mb.mb_id, self._stage0.submit(self._execute, mb)

    def _execute(self, mb: MicroBatch) -> tuple:
        out, timing = self.worker.execute(mb)
        return _result(self.worker, out), timing

    def wait(self, handle: tuple[int, Future]) -> SampledTokens:
        mb_id, own = handle
        results = [own.result()] + [self.ctrl.recv(r, wire.RESULT) for r in range(1, self.world)]
        return SampledTokens(mb_id, results[self.last][0], tuple(t for _, t in results))

    def shutdown(self) -> None:
        """Let rank 0's stage-0 thread finish what it holds; tell every other rank to stop
        (they leave `serve`)."""
        self._stage0.shutdown(wait=True)
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
