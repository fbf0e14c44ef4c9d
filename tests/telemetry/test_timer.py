"""The one timer (`telemetry/timer.py`): host spans measure what they wrap and nest in order;
the CUDA implementation's arithmetic (events placed on the host clock through a moving
anchor, float32 milliseconds) is checked with fake events, no GPU needed; and a CPU run of
the stage workers never touches CUDA (no synchronize, no event)."""
import time

import numpy as np
import pytest
import torch

from pp_runtime import LLM, SamplingParams
from pp_runtime.config import load_config
from pp_runtime.telemetry.timer import CudaEventTimer, HostTimer, Op, Spans, device_timer


def test_the_op_names_are_the_stage_timing_parts():
    assert [op.name for op in Op] == ["RECV_WAIT", "TRANSFER", "COMPUTE", "SEND_WAIT"]
    assert Spans({Op.COMPUTE: (2.0, 2.5)}).seconds(Op.COMPUTE) == 0.5
    assert Spans().seconds(Op.RECV_WAIT) == 0.0  # not recorded: stage 0 receives nothing


def test_host_spans_measure_sleeps():
    """Each span holds its sleep (a sleep never ends early) and lies within the wall time
    read around it: bounds that hold however loaded the machine is."""
    rec, outer = HostTimer().record(), {}
    for op, sleep_s in ((Op.RECV_WAIT, 0.05), (Op.COMPUTE, 0.1)):
        t0 = time.perf_counter()
        with rec.span(op):
            time.sleep(sleep_s)
        outer[op] = (t0, time.perf_counter())
    spans = rec.resolve()
    for op, sleep_s in ((Op.RECV_WAIT, 0.05), (Op.COMPUTE, 0.1)):
        assert sleep_s <= spans.seconds(op) <= outer[op][1] - outer[op][0]
        assert outer[op][0] <= spans[op][0] <= spans[op][1] <= outer[op][1]  # the host clock
    assert spans[Op.RECV_WAIT][1] <= spans[Op.COMPUTE][0]  # one after the other


def test_spans_nest_and_keep_their_order():
    ticks = iter(range(100))
    rec = HostTimer(clock=lambda: float(next(ticks))).record()
    with rec.span(Op.TRANSFER):  # 0 .. 3
        with rec.span(Op.RECV_WAIT):  # 1 .. 2
            pass
    with rec.span(Op.COMPUTE):  # 4 .. 5
        pass
    spans = rec.resolve()
    assert spans == {Op.TRANSFER: (0.0, 3.0), Op.RECV_WAIT: (1.0, 2.0), Op.COMPUTE: (4.0, 5.0)}
    assert list(spans) == [Op.RECV_WAIT, Op.TRANSFER, Op.COMPUTE]  # in the order they ended


def test_an_op_recorded_twice_in_one_call_is_an_error():
    rec = HostTimer().record()
    with rec.span(Op.COMPUTE):
        pass
    with pytest.raises(ValueError, match="COMPUTE recorded twice"):
        with rec.span(Op.COMPUTE):
            pass


def test_a_span_whose_body_raises_records_nothing():
    rec = HostTimer().record()
    with pytest.raises(KeyError):
        with rec.span(Op.COMPUTE):
            raise KeyError("boom")
    assert rec.resolve() == {}


class FakeGpu:
    """One stream whose clock the test sets (seconds, an origin unrelated to the host's)."""

    def __init__(self, t: float):
        self.t, self.waited = t, []


class FakeEvent:
    """The torch.cuda.Event calls the timer makes; elapsed_time in float32 ms like CUDA's."""

    def __init__(self, gpu: FakeGpu):
        self.gpu, self.t = gpu, gpu.t  # when the stream reached it

    def synchronize(self):
        self.gpu.waited.append(self)

    def elapsed_time(self, end: "FakeEvent") -> float:
        return float(np.float32((end.t - self.t) * 1e3))


def fake_timer(gpu_t=1000.0, host_t=5.0):
    """A timer whose anchor is GPU time gpu_t = host time host_t; gpu.marks: every event."""
    gpu = FakeGpu(gpu_t)
    gpu.marks = []

    def mark():
        gpu.marks.append(FakeEvent(gpu))
        return gpu.marks[-1]

    return gpu, CudaEventTimer(mark, FakeEvent(gpu), host_t)


def test_events_are_placed_on_the_host_clock_through_the_anchor():
    gpu, timer = fake_timer(gpu_t=1000.0, host_t=5.0)  # anchor: GPU 1000 s = host 5 s
    rec = timer.record()
    gpu.t = 1000.25
    with rec.span(Op.RECV_WAIT):
        gpu.t = 1000.5  # the stream waited for the header until here
    with rec.span(Op.COMPUTE):
        gpu.t = 1000.75
    spans = rec.resolve()
    assert spans[Op.RECV_WAIT] == pytest.approx((5.25, 5.5), abs=1e-6)
    assert spans[Op.COMPUTE] == pytest.approx((5.5, 5.75), abs=1e-6)
    # it waited for this call's end events only, the last one last, and moved the anchor there
    assert [e.t for e in gpu.waited] == [1000.5, 1000.75]
    assert timer.anchor is gpu.waited[-1] and timer.anchor_s == pytest.approx(5.75, abs=1e-6)


def test_spans_are_when_the_stream_got_there_not_when_the_host_recorded():
    """A host far ahead of the GPU (kernels queued) records both events at once; the span
    is where the stream reached them."""
    gpu, timer = fake_timer(gpu_t=1000.0, host_t=5.0)
    rec = timer.record()
    with rec.span(Op.COMPUTE):
        pass
    start, end = gpu.marks
    start.t, end.t = 1002.0, 1002.5  # the stream got there 2 s after the anchor
    assert rec.resolve()[Op.COMPUTE] == pytest.approx((7.0, 7.5), abs=1e-6)


def test_a_moving_anchor_keeps_gaps_exact_over_hours():
    """elapsed_time is float32 ms, so from one fixed anchor an event 3 hours later is placed
    to ~1 ms only, and the gaps between calls (the bubbles) would be off by as much. The
    anchor moves to every call's last event: durations and gaps stay exact to 1 us, and the
    clock as a whole runs off by float32 rounding only (< 2**-24 of the elapsed time)."""
    gpu, timer = fake_timer(gpu_t=0.0, host_t=0.0)
    fixed = FakeEvent(FakeGpu(0.0))  # what a single anchor at the start would use
    prev_end = fixed_prev_end = None
    for k in range(10_800):  # a call every second
        rec = timer.record()
        gpu.t = k + 0.02
        with rec.span(Op.COMPUTE):
            gpu.t += 0.0123
        start, end = rec.resolve()[Op.COMPUTE]
        assert end - start == pytest.approx(0.0123, abs=1e-6)
        if prev_end is not None:
            assert start - prev_end == pytest.approx(1 - 0.0123, abs=1e-6)
        prev_end = end
        fixed_start = fixed.elapsed_time(gpu.marks[-2]) / 1e3
        if fixed_prev_end is not None:
            fixed_gap_error = abs(fixed_start - fixed_prev_end - (1 - 0.0123))
        fixed_prev_end = fixed.elapsed_time(gpu.marks[-1]) / 1e3
    assert start == pytest.approx(k + 0.02, abs=(k + 1) * 2**-24)
    assert fixed_gap_error > 1e-5  # the single anchor's gaps late in the run are coarse


def test_a_record_with_no_spans_waits_for_nothing():
    gpu, timer = fake_timer()
    assert timer.record().resolve() == {} and gpu.waited == []


def test_the_cpu_device_gets_the_host_timer():
    assert isinstance(device_timer(torch.device("cpu")), HostTimer)


def test_the_cpu_path_never_touches_cuda(monkeypatch):
    """pp=2 in one process: every stage's StageTiming comes from perf_counter, and neither
    torch.cuda.synchronize nor a CUDA event is ever called."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the CPU path called into CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda, "Event", forbidden)
    timings = []
    with LLM(load_config("tiny", pp=2, executor="local", device="cpu")) as llm:
        outs = llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]],
                            SamplingParams(max_tokens=4, ignore_eos=True),
                            on_microbatch=lambda mb, out: timings.extend(out.timings))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert {t.stage for t in timings} == {0, 1}
    for stage in (0, 1):
        mine = [t for t in timings if t.stage == stage]
        assert all(t.compute_end_s > t.compute_start_s for t in mine)
        # one clock per stage: consecutive calls never overlap
        assert all(a.compute_end_s <= b.compute_start_s for a, b in zip(mine, mine[1:]))
    # the in-process executor hands activations over in memory: no wait, no transfer
    assert all(t.wait_s == t.transfer_s == t.send_wait_s == 0.0 for t in timings)
