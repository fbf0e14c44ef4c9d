"""The driver's Protocols are complete: every planner has every `Planner` member, and the
online engine's intake works through them alone (add, admit, queued, abort, forget)."""
import pytest

from pp_runtime.core import driver
from pp_runtime.core.batch import SampledTokens
from pp_runtime.core.request import FinishReason
from pp_runtime.planner import PLANNERS
from planner.helpers import add, planner


def members(protocol) -> list[str]:
    return [m for m in vars(protocol) if not m.startswith("_")]


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_has_every_member_of_the_planner_protocol(name):
    p = planner(name)
    assert members(driver.Planner), "the protocol names nothing"
    for m in members(driver.Planner):
        assert callable(getattr(p, m, None)), f"{name} lacks Planner.{m}"


@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_the_intake_methods_queue_abort_and_forget(name):
    """One KV slot: r0 is admitted, r1 has arrived and waits for blocks, r2 arrives later.
    An abort ends a waiting request at once and an admitted one only once its micro-batch
    is back, freeing its slot for the next."""
    p = planner(name, kv_slots=1, max_batch_size=1)
    add(p, 0, 4, 2)
    add(p, 1, 4, 2)
    add(p, 2, 4, 2, arrival=5.0)
    assert p.num_waiting() == 3
    mb = p.schedule(0.0)  # admits (some policies admit as they compose)
    r0, r1, r2 = (p.requests[i] for i in range(3))
    assert [s.request_id for s in mb.seqs] == [0] and r0.blocks is not None
    assert p.queued(0.0) == [r1]  # r2 has not arrived
    assert p.num_waiting() == 2

    assert p.abort(r1, FinishReason.ABORTED, 0.5) and r1.finish_reason == FinishReason.ABORTED
    assert p.queued(0.0) == [] and p.num_waiting() == 1

    assert not p.abort(r0, FinishReason.ABORTED, 1.0) and not r0.finished  # in flight
    p.on_result(mb, SampledTokens(mb.mb_id, {0: 7}), 2.0)
    assert p.abort(r0, FinishReason.ABORTED, 2.0) and r0.finish_reason == FinishReason.ABORTED
    assert r0.blocks is None  # its slot is free again
    p.forget(0)
    assert 0 not in p.requests
    mb = p.schedule(6.0)
    assert [s.request_id for s in mb.seqs] == [2] and p.queued(6.0) == []


def executor_classes():
    from pp_runtime.executors.local import LocalExecutor
    from pp_runtime.executors.ray_executor import RayExecutor
    from pp_runtime.executors.sim import SimExecutor
    from pp_runtime.executors.torchrun_executor import TorchrunExecutor
    return [LocalExecutor, RayExecutor, SimExecutor, TorchrunExecutor]


DEVICE_ONCE_BUILT = ("LocalExecutor", "RayExecutor", "TorchrunExecutor")


def test_every_executor_class_has_every_member_of_the_executor_protocol():
    """Methods on the class; `name` a class attribute; `device` a class attribute, or set
    by the executor as it starts its workers, checked on one built: the local one and
    torchrun's (below), Ray's (tests/parallel/test_ray_runtime.py, the greedy test)."""
    methods = [m for m in members(driver.Executor) if callable(getattr(driver.Executor, m))]
    assert {"describe", "submit", "wait", "shutdown"} <= set(methods)
    assert {"name", "device"} <= set(driver.Executor.__annotations__)
    for cls in executor_classes():
        for m in methods:
            assert callable(getattr(cls, m, None)), f"{cls.__name__} lacks Executor.{m}"
        assert isinstance(getattr(cls, "name", None), str), f"{cls.__name__} lacks a name"
        assert hasattr(cls, "device") or cls.__name__ in DEVICE_ONCE_BUILT, cls


def test_a_torchrun_executor_has_its_stage_workers_device():
    from types import SimpleNamespace

    from pp_runtime.executors.torchrun_executor import TorchrunExecutor

    ex = TorchrunExecutor(SimpleNamespace(device="cpu"), None, world_size=1, tp=1)
    try:
        assert ex.device == "cpu" and ex.name == "torchrun"
    finally:
        ex._stage0.shutdown()  # its stage-0 thread; no peers to tell (no control channel)


def test_a_local_and_a_simulated_executor_are_executors_the_engine_runs_unwrapped():
    """Built for real (the local one on a tiny CPU model): every member answers, and the
    engine drives the executor itself (its stamps and the metrics are driver hooks)."""
    from pp_runtime.config import load_config
    from pp_runtime.engine.online import Engine
    from pp_runtime.executors.local import LocalExecutor
    from pp_runtime.executors.sim import SimExecutor, VirtualClock

    class Free:
        def stage_times(self, prefills, decodes):
            return [0.0, 0.0]

        def send_time(self, num_tokens, stage):
            return 0.0

    cfg = load_config("tiny", pp=2, executor="local", device="cpu")
    clock = VirtualClock()
    for ex in (LocalExecutor(cfg), SimExecutor(Free(), 2, clock)):
        engine = Engine(cfg, ex, clock=clock, sleep=clock.sleep)
        assert engine._executor is ex
        assert str(ex.device) in ("cpu", "cuda", "sim") and ex.name in ex.describe()
        engine.close()
        engine._executor.shutdown()
        ex.shutdown()  # a second call does nothing
