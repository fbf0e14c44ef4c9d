"""The torchrun executor's rank 0: the driver's submit does not wait for stage 0's work.

A one-rank gloo world (a real process group and control channel); the stage is held by a
gate, so a submit that ran stage 0 on the driver's thread would never return."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from pp_runtime.core.batch import MicroBatch, RankResult, Sampling, SeqChunk, StageTiming
from pp_runtime.executors.torchrun_executor import ControlChannel, TorchrunExecutor
from pp_runtime.core.net import free_port


class GatedStage:
    """Stage 0 of a one-stage pipeline: computes only once the gate opens; notes the order."""

    tp_rank, device, link = 0, "cpu", None

    def __init__(self) -> None:
        self.gate, self.ran, self.threads = threading.Event(), [], set()

    def execute(self, mb: MicroBatch):
        assert self.gate.wait(30), "the gate never opened"
        self.ran.append(mb.mb_id)
        self.threads.add(threading.current_thread().name)
        timing = StageTiming(mb.mb_id, 0, 0, 0.0, 0.0, 0.0, 0.001)
        return RankResult(timing, {s.request_id: 7 for s in mb.seqs}), None


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        yield ControlChannel(dist.new_group([0], backend="gloo"))
    finally:
        dist.destroy_process_group()


def _mb(i: int) -> MicroBatch:
    return MicroBatch(i, (SeqChunk(i, [0], 0, (1, 2, 3), Sampling(0.0, 1.0, 0)),))


def test_submit_returns_while_stage_zero_computes_and_results_keep_their_order(world_of_one):
    stage = GatedStage()
    ex = TorchrunExecutor(stage, world_of_one, world_size=1, tp=1)
    done = threading.Event()
    handles = []

    def driver():
        handles.extend(ex.submit(_mb(i)) for i in range(3))
        done.set()

    threading.Thread(target=driver, daemon=True).start()
    assert done.wait(5), "submit waited for stage 0's work (the gate is closed)"
    assert stage.ran == []
    t0 = time.perf_counter()
    stage.gate.set()
    outs = [ex.wait(h) for h in handles]
    assert time.perf_counter() - t0 < 5
    assert [o.mb_id for o in outs] == [0, 1, 2] and stage.ran == [0, 1, 2]
    assert outs[1].tokens == {1: 7} and outs[1].timings[0].mb_id == 1
    assert stage.threads and threading.current_thread().name not in stage.threads
    ex.shutdown()


def test_an_error_in_stage_zero_reaches_wait(world_of_one):
    stage = GatedStage()
    stage.execute = lambda mb: (_ for _ in ()).throw(RuntimeError("stage 0 broke"))
    ex = TorchrunExecutor(stage, world_of_one, world_size=1, tp=1)
    handle = ex.submit(_mb(0))
    with pytest.raises(RuntimeError, match="stage 0 broke"):
        ex.wait(handle)
    ex.shutdown()


def test_a_stage_that_hangs_fails_the_wait_after_the_timeout_and_shutdown_does_not_wait(
        world_of_one):
    """Past `timeout_s` (runtime.step_timeout_s) wait raises; the executor is then failed,
    and shutdown neither waits for the hung stage nor tells the peers to stop."""
    stage = GatedStage()  # the gate never opens: a hung stage 0
    ex = TorchrunExecutor(stage, world_of_one, world_size=1, tp=1, timeout_s=0.3)
    handle = ex.submit(_mb(0))
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not finish micro-batch 0 within 0.3 s"):
        ex.wait(handle)
    assert ex.failed
    ex.shutdown()
    assert time.perf_counter() - t0 < 5
    stage.gate.set()  # let the thread go
