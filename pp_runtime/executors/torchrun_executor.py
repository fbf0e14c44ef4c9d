"""The torchrun executor: one stage worker per torchrun process; rank 0 also drives.

Rank r = stage * tp + tp_rank, as for Ray. Rank 0 (stage 0, TP rank 0) runs the planner and
the driver loop. `submit(mb)` broadcasts the plan to every other rank over a gloo CPU group (the
control channel, also with NCCL for the activations: one asynchronous broadcast, not
world - 1 sends) and hands rank 0's own stage-0 work to a thread of its own, so the driver
plans the next micro-batch while stage 0 computes this one (the thread takes them in
order; torch releases the GIL while it computes). The other ranks (`serve`) take plans in
order, execute them, and send back their `RankResult`. `wait(mb)` collects those in rank
order, rank 0's from its thread, and `assemble`s the SampledTokens. The control channel (`executors/control.py`,
rooted at rank 0) never blocks a send (isend, async broadcast), so a rank busy with its
stage never stalls another. Messages are JSON typed by the dataclasses
(`executors/wire.py`), never pickles.

A rank that dies takes the job down through torchrun's agent, which restarts the whole
group (within `--max-restarts`; rank 0 resumes from its journal, docs/recovery.md). A rank
that hangs: `wait` gives up on a result after `timeout_s` (`runtime.step_timeout_s`),
raises, and from then on the executor talks to no peer again (`shutdown` neither waits
for stage 0 nor tells the others to stop), so rank 0 exits non-zero at once.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch.distributed as dist

from pp_runtime.executors import wire
from pp_runtime.executors.control import ControlChannel
from pp_runtime.core.batch import MicroBatch, RankResult, SampledTokens, assemble
from pp_runtime.worker.stage import StageWorker


class TorchrunExecutor:
    """Rank 0's executor: the driver's `submit` / `wait` over the control channel."""

    name = "torchrun"
    path = ""  # one way to reach the stages (driver.Executor)

    def __init__(self, worker: StageWorker, ctrl: ControlChannel, world_size: int, tp: int,
                 timeout_s: float | None = None):
        self.worker, self.ctrl, self.world, self.tp = worker, ctrl, world_size, tp
        self.timeout_s = timeout_s  # per result; None: wait as long as gloo's group does
        self.failed = False  # a wait raised: the pipeline is broken, peers are not told
        # rank 0's stage-0 work, in submission order, off the driver's thread
        self._stage0 = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage0")
        self.device = worker.device  # what the stages run on (reports name it)
        # runtime.token_hop, resolved alike on every rank (cli/torchrun.py): the engine
        # plans ahead; stage 0's thread fills the placeholders from the last stage's ids
        self.token_hop = getattr(worker, "hop", None) is not None

    def describe(self) -> str:
        hop = " + token hop" if self.token_hop else ""
        return f"torchrun ({self.world} ranks, {dist.get_backend()}){hop}"

    def submit(self, mb: MicroBatch) -> tuple[int, Future]:
        self.ctrl.broadcast(mb, wire.PLAN)  # one message to every rank, not world - 1
        return mb.mb_id, self._stage0.submit(self._execute, mb)

    def _execute(self, mb: MicroBatch) -> RankResult:
        return self.worker.execute(mb)[0]

    def wait(self, handle: tuple[int, Future]) -> SampledTokens:
        mb_id, own = handle
        try:
            results = [self._own(mb_id, own)]
            results += [self._peer(mb_id, r) for r in range(1, self.world)]
        except Exception:
            self.failed = True
            raise
        return assemble(mb_id, results)

    def _own(self, mb_id: int, own: Future) -> RankResult:
        try:
            return own.result(self.timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"stage 0 (rank 0) did not finish micro-batch {mb_id} within "
                               f"{self.timeout_s:g} s (runtime.step_timeout_s)") from None

    def _peer(self, mb_id: int, rank: int) -> RankResult:
        try:
            return self.ctrl.recv(rank, wire.RESULT, self.timeout_s)
        except RuntimeError as exc:  # gloo: the peer's socket closed, or the time ran out
            raise RuntimeError(f"rank {rank} (stage {rank // self.tp}), micro-batch {mb_id}: "
                               f"{exc} (runtime.step_timeout_s {self.timeout_s})") from exc

    def shutdown(self) -> None:
        """Let rank 0's stage-0 thread finish what it holds; tell every other rank to stop
        (they leave `serve`). After a failed `wait`, neither: a broken pipeline could
        hold either forever, and the caller exits (torchrun's agent ends the others)."""
        self._stage0.shutdown(wait=not self.failed, cancel_futures=self.failed)
        if self.world and not self.failed:
            if self.token_hop:  # the token hop's messages still due (every one was sent)
                self.worker.close_hop()
            if self.worker.link is not None:  # stage 1's receive posted ahead: ended
                self.worker.link.close()
            self.ctrl.broadcast(None, wire.PLAN)
            self.ctrl.flush()
            self.world = 0


def serve(worker: StageWorker, ctrl: ControlChannel) -> int:
    """A rank other than 0: execute plans from rank 0 in order until told to stop;
    returns how many micro-batches it ran."""
    n = 0
    while (mb := ctrl.recv_broadcast(wire.PLAN)) is not None:
        ctrl.send(worker.execute(mb)[0], wire.RESULT, 0)
        n += 1
    worker.close_hop()  # the last stage: until rank 0 took its token messages
    if worker.link is not None:
        worker.link.close()  # the receive posted ahead ended (parallel/p2p.StageLink.close)
    ctrl.flush()
    return n
