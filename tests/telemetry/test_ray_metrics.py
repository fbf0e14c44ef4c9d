"""Live metrics (`telemetry/metrics.py`): the online numbers equal `bubbles.account()` on a
hand-made schedule (no Ray), and a real PP=2 Ray run exports every series at the metrics
export port of a Ray started on 127.0.0.1, with the same per-stage seconds as its report."""
import json
import os
import re
import sys
import time
import types
import urllib.request
from collections import defaultdict
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray port on 127.0.0.1

import pytest  # noqa: E402

from pp_runtime.core.batch import MicroBatch, Sampling, SampledTokens, SeqChunk, StageTiming  # noqa: E402
from pp_runtime.core.request import FinishReason, Request, SamplingParams  # noqa: E402
from pp_runtime.telemetry.bubbles import account  # noqa: E402
from pp_runtime.telemetry.metrics import (SPECS, Kind, Metric, NullSink, RuntimeMetrics,  # noqa: E402
                                          default_sink)
from pp_runtime.core.net import free_port  # noqa: E402


class MemorySink:
    """Keeps every value: counters summed, gauges' last value, histograms' observations."""

    def __init__(self):
        self.counters, self.gauges = defaultdict(float), {}
        self.observed, self.gauge_history = defaultdict(list), defaultdict(list)

    def record(self, metric, value, tags):
        key = (metric, tuple(sorted(tags.items())))
        kind = SPECS[metric].kind
        if kind is Kind.COUNTER:
            self.counters[key] += value
        elif kind is Kind.GAUGE:
            self.gauges[key] = value
            self.gauge_history[key].append(value)
        else:
            self.observed[key].append(value)


DEP = (("deployment", "m-tp1xpp2"),)


def stage_key(metric, stage):
    return metric, tuple(sorted(DEP + (("stage", str(stage)),)))


def cause_key(metric, stage, cause):
    return metric, tuple(sorted(DEP + (("stage", str(stage)), ("cause", cause))))


def T(mb, stage, start, end, wait=0.0, transfer=0.0, tp_rank=0, send_wait=0.0, token=0.0):  # noqa: N802
    return StageTiming(mb, stage, tp_rank, wait, transfer, start, end, send_wait, token)


SAMPLE = Sampling(0.0, 1.0, 0)


def test_online_bubbles_equal_account_on_a_hand_made_schedule():
    """stage 0: m0 [0,1)  m1 [1,5) then blocked 0.5 on its send (downstream)  m2 [8,9):
             the driver was idle 2 before m2 (idle 2, dependency 0.5, of it 0.3 holding
             m2's call while its decode's token came on the hop)
    stage 1: m0 [1.5,2.5) after wait 1 + transfer 0.5 (fill); m1 [5.5,9.5) after transfer
             0.5 + wait 2.5 (PB1); m2 [10,11) after transfer 0.25 and 0.25 idle.
    r0: m0 (whole prompt, samples) and m2 (decode, finishes); r1: m1 (whole prompt, one
    token, finishes); r2: m1 (first chunk) and m2 (last chunk, first token, finishes)."""
    timings = {0: [T(0, 0, 0, 1), T(0, 1, 1.5, 2.5, wait=1, transfer=0.5)],
               1: [T(1, 0, 1, 5, send_wait=0.5), T(1, 1, 5.5, 9.5, wait=2.5, transfer=0.5)],
               2: [T(2, 0, 8, 9, token=0.3), T(2, 1, 10, 11, transfer=0.25)]}
    for mb_timings in timings.values():  # TP rank 1 runs in lock step and is not counted
        mb_timings += [T(t.mb_id, t.stage, t.compute_start_s, t.compute_end_s + 0.5, tp_rank=1)
                       for t in list(mb_timings)]
    reqs = {i: Request(i, [1] * n, SamplingParams(max_tokens=m), 0, arrival_s=a)
            for i, (n, m, a) in enumerate([(4, 2, 0.0), (8, 1, 0.5), (12, 1, 1.0)])}
    mbs = [MicroBatch(0, (SeqChunk(0, 0, 0, (1,) * 4, SAMPLE),)),
           MicroBatch(1, (SeqChunk(1, 1, 0, (1,) * 8, SAMPLE), SeqChunk(2, 2, 0, (1,) * 4, None))),
           MicroBatch(2, (SeqChunk(0, 0, 4, (7,), SAMPLE, is_decode=True),
                          SeqChunk(2, 2, 4, (1,) * 8, SAMPLE)), idle_before_s=2.0)]
    done_at = {0: 3.0, 1: 10.0, 2: 12.0}  # driver clock when each result came back
    finishes = {1: [1], 2: [0, 2]}  # what the planner finished in each micro-batch
    now = [0.0]
    sink = MemorySink()
    metrics = RuntimeMetrics("m-tp1xpp2", reqs, lambda: now[0], sink=sink)
    for mb in mbs:
        now[0] = done_at[mb.mb_id]
        out = SampledTokens(mb.mb_id, {s.request_id: 5 for s in mb.seqs if s.sampling},
                            tuple(timings[mb.mb_id]))
        for s in mb.seqs:  # what planner.on_result does before the callback
            r = reqs[s.request_id]
            if s.sampling:
                r.output_token_ids.append(5)
                r.first_token_s = r.first_token_s if r.first_token_s is not None else now[0]
        for rid in finishes.get(mb.mb_id, []):
            reqs[rid].finish_reason, reqs[rid].finish_s = FinishReason.LENGTH, now[0]
        metrics.on_microbatch(mb, out)
    metrics.flush()  # the per-stage series are summed and sent every FLUSH_S and on a drain

    rep = account([t for ts in timings.values() for t in ts], {mb.mb_id: [s.request_id for s in mb.seqs]
                                                               for mb in mbs},
                  idle_before_s={mb.mb_id: mb.idle_before_s for mb in mbs})
    assert [s.bubble_by_cause_s for s in rep.per_stage] == [  # the schedule is what it says
        {"upstream": 0, "downstream": 0.5, "dependency": 0.5},
        {"upstream": 3.5, "downstream": 0, "dependency": 0}]
    assert [s.idle_s for s in rep.per_stage] == [2, 0.25]
    assert [s.token_s for s in rep.per_stage] == [pytest.approx(0.3), 0]
    for s in rep.per_stage:
        assert sink.counters[stage_key(Metric.STAGE_BUSY, s.stage)] == pytest.approx(s.busy_s)
        for cause, seconds in s.bubble_by_cause_s.items():
            assert sink.counters[cause_key(Metric.STAGE_BUBBLE, s.stage, cause)] == pytest.approx(seconds)
            assert sink.gauges[cause_key(Metric.STAGE_BUBBLE_FRACTION, s.stage, cause)] == pytest.approx(
                seconds / s.wall_s)
        assert sink.counters[stage_key(Metric.STAGE_IDLE, s.stage)] == pytest.approx(s.idle_s)
        assert sink.counters[stage_key(Metric.STAGE_DEPENDENCY_TOKEN, s.stage)] == pytest.approx(s.token_s)
        assert sink.counters[stage_key(Metric.STAGE_TRANSFER, s.stage)] == pytest.approx(s.transfer_s)
        assert sink.counters[stage_key(Metric.STAGE_WALL, s.stage)] == pytest.approx(s.wall_s)
        assert metrics.stages[s.stage].stats() == s  # the same accumulator, the same numbers
    # per request, recorded when it finished (r0 and r2 in m2, after r1 in m1)
    assert sink.observed[(Metric.REQUEST_BUBBLE, DEP)] == pytest.approx(
        [rep.request_bubble_s[1], rep.request_bubble_s[0], rep.request_bubble_s[2]])
    assert rep.request_bubble_s == {0: 1.0, 1: 3.0, 2: 3.0}
    assert sink.observed[(Metric.REQUEST_TTFT, DEP)] == pytest.approx([10.0 - 0.5, 3.0 - 0.0, 12.0 - 1.0])
    assert sink.observed[(Metric.REQUEST_TBT, DEP)] == pytest.approx([12.0 - 3.0])  # r0's one gap
    tokens = {kind: sink.observed[(Metric.MB_TOKENS, DEP + (("kind", kind),))]
              for kind in ("prefill", "decode")}
    assert tokens == {"prefill": [4, 12, 8], "decode": [0, 0, 1]}


def test_per_stage_series_are_summed_not_sent_per_microbatch():
    """500 micro-batches on two stages within one flush interval: one record per series
    (not ten per stage per micro-batch), with the same totals; a drained pipeline sends."""
    calls = []

    class Counting(MemorySink):
        def record(self, metric, value, tags):
            calls.append(metric)
            super().record(metric, value, tags)

    sink = Counting()
    metrics = RuntimeMetrics("m-tp1xpp2", {}, lambda: 0.0, sink=sink)
    metrics.set_in_flight(2)  # a busy pipeline: results come back while others are in it
    t = 0.0
    for i in range(500):
        mb = MicroBatch(i, (SeqChunk(0, 0, 0, (1,) * 4, None),))
        timings = (T(i, 0, t, t + 1), T(i, 1, t + 1.5, t + 2.5, wait=1, transfer=0.5))
        metrics.on_microbatch(mb, SampledTokens(i, {}, timings))
        t += 3
    stage_calls = [m for m in calls if m.value.startswith("pp_runtime_stage")]
    assert len(stage_calls) < 50, len(stage_calls)  # was 10 per stage per micro-batch: 10000
    metrics.set_in_flight(0)  # the pipeline drained: everything summed is sent
    assert sink.counters[stage_key(Metric.STAGE_BUSY, 0)] == pytest.approx(500.0)
    assert sink.counters[stage_key(Metric.STAGE_BUSY, 1)] == pytest.approx(500.0)
    assert sink.counters[stage_key(Metric.STAGE_TRANSFER, 1)] == pytest.approx(250.0)
    assert len(sink.observed[(Metric.MB_TOKENS, DEP + (("kind", "prefill"),))]) == 500


def test_in_flight_and_queue_depth_follow_the_drivers_hooks():
    """Submitted, collected, lost: the gauge counts each once and returns to 0."""
    sink, waiting = MemorySink(), [3]
    m = RuntimeMetrics("m-tp1xpp2", {}, lambda: 0.0, lambda: waiting[0], sink)
    a, b, c = (MicroBatch(i, ()) for i in range(3))
    m.on_submit(a)
    waiting[0] = 2
    m.on_submit(b)
    m.on_collect(a, SampledTokens(0))
    m.on_collect(b, SampledTokens(1))
    m.on_submit(c)
    m.on_collect(c, None)  # lost in a failure: not in flight any more either
    assert sink.gauge_history[(Metric.IN_FLIGHT, DEP)] == [1, 2, 1, 0, 1, 0]
    assert sink.gauge_history[(Metric.QUEUE_DEPTH, DEP)] == [3, 2, 2, 2, 2, 2]


def test_without_a_running_ray_nothing_is_exported(monkeypatch):
    """The in-process executor and the simulator never import or need Ray."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert isinstance(default_sink(), NullSink)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: False))
    assert isinstance(default_sink(), NullSink)


def test_metric_names_are_prometheus_names():
    for m in Metric:
        assert m.value.startswith("pp_runtime_") and m.value.replace("_", "").isalnum()
        spec = SPECS[m]
        assert "deployment" in spec.tag_keys
        assert (spec.kind is Kind.HISTOGRAM) == bool(spec.boundaries)
        assert list(spec.boundaries) == sorted(set(spec.boundaries))


def test_grafana_dashboard_queries_every_exported_series_and_nothing_else():
    dashboard = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pp_runtime.json"
    panels = json.loads(dashboard.read_text())["panels"]
    names = []
    for target in (t for p in panels for t in p.get("targets", [])):
        assert "__name__" not in target["expr"]  # rate() over a name regex: duplicate labelsets
        names += re.findall(r"ray_pp_runtime_\w+", target["expr"])
    base = {name: Metric(re.sub(r"_(total|bucket|count|sum)$", "", name)[len("ray_"):]) for name in names}
    assert set(base.values()) == set(Metric)
    suffix = {Kind.COUNTER: ("_total",), Kind.GAUGE: ("",), Kind.HISTOGRAM: ("_bucket", "_count", "_sum")}
    for name, metric in base.items():  # counters as _total, histograms by their parts
        assert name in {"ray_" + metric.value + sfx for sfx in suffix[SPECS[metric].kind]}, name


# ---- a real Ray run ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_metrics_port():
    """A new local Ray with its dashboard, every port on 127.0.0.1 (`address="local"`: never
    a `ray start` head that happens to run here); yields the metrics port."""
    ray = pytest.importorskip("ray")
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1",
             dashboard_port=free_port(), _metrics_export_port=port,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    yield port
    ray.shutdown()


def _scrape(port: int) -> dict[str, list[tuple[dict, float]]]:
    """Our series at the metrics port: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = defaultdict(list)
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name.startswith("ray_pp_runtime_"):
                out[s.name].append((s.labels, s.value))
    return out


def _value(series, name, **labels) -> float:
    """The one sample of `name` with these labels."""
    hits = [v for lab, v in series.get(name, []) if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(hits) == 1, (name, labels, series.get(name))
    return hits[0]


def test_a_ray_run_exports_every_series(ray_metrics_port):
    from pp_runtime import LLM
    from pp_runtime.config import load_config
    from pp_runtime.telemetry.recorder import RunRecorder

    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((37, 9, 52, 20, 3))]
    rec = RunRecorder(time.perf_counter)
    with LLM(load_config("tiny", pp=2, executor="ray", threads_per_worker=1)) as llm:
        assert llm.executor.name == "ray" and llm.config.runtime.metrics
        outs = llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), on_microbatch=rec)
    n, gaps = len(prompts), sum(len(o.token_ids) - 1 for o in outs)
    assert all(o.finish_reason == FinishReason.LENGTH for o in outs)
    dep = "tiny-gpt-tp1xpp2"

    def complete(series) -> bool:  # exported 5-10 s after recording
        counts = [v for name in ("ray_pp_runtime_request_ttft_seconds_count",
                                 "ray_pp_runtime_request_bubble_seconds_count")
                  for _, v in series.get(name, [])]
        return counts == [n, n] and len(series.get("ray_pp_runtime_stage_busy_seconds_total", [])) == 2

    deadline, series = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        series = _scrape(ray_metrics_port)
        if complete(series):
            break
        time.sleep(1)
    assert complete(series), sorted(series)

    for name, samples in series.items():  # every sample names its deployment
        assert all(lab["deployment"] == dep for lab, _ in samples), name
    rep = rec.bubbles()
    for s in rep.per_stage:  # the live per-stage seconds are the report's
        st = str(s.stage)
        assert _value(series, "ray_pp_runtime_stage_busy_seconds_total", stage=st) > 0
        for kind in ("busy", "transfer", "idle", "wall"):
            expected = getattr(s, f"{kind}_s")
            if expected > 0:  # a counter appears once it grows
                got = _value(series, f"ray_pp_runtime_stage_{kind}_seconds_total", stage=st)
                assert got == pytest.approx(expected), kind
        for cause, expected in s.bubble_by_cause_s.items():
            if expected > 0:
                got = _value(series, "ray_pp_runtime_stage_bubble_seconds_total", stage=st, cause=cause)
                assert got == pytest.approx(expected), cause
            assert _value(series, "ray_pp_runtime_stage_bubble_fraction", stage=st,
                          cause=cause) == pytest.approx(expected / s.wall_s)
    assert rep.per_stage[1].upstream_s > 0  # stage 1 waits for stage 0 (at least the fill)
    assert rep.per_stage[0].dependency_s > 0  # stage 0 waits for sampled tokens
    assert "ray_pp_runtime_stage_transfer_seconds_total" in series

    for name in ("request_ttft_seconds", "request_bubble_seconds"):  # histograms, one per request
        assert _value(series, f"ray_pp_runtime_{name}_count") == n
        assert _value(series, f"ray_pp_runtime_{name}_bucket", le="+Inf") == n
    assert _value(series, "ray_pp_runtime_request_tbt_seconds_count") == gaps
    assert _value(series, "ray_pp_runtime_request_ttft_seconds_sum") > 0

    num_mbs = rec.num_microbatches
    for kind in ("prefill", "decode"):
        assert _value(series, "ray_pp_runtime_microbatch_tokens_count", kind=kind) == num_mbs
    # the smallest bucket (<= 1 token) holds the decode-only micro-batches' prefill count
    no_prefill = sum(1 for n in rec.mb_columns["prefill_tokens"] if n == 0)
    assert _value(series, "ray_pp_runtime_microbatch_tokens_bucket", kind="prefill", le="1.0") == no_prefill
    assert any(rec.mb_columns["decodes"])
    assert _value(series, "ray_pp_runtime_microbatch_tokens_bucket", kind="decode", le="+Inf") == num_mbs

    assert _value(series, "ray_pp_runtime_microbatches_in_flight") == 0  # the run is over
    assert _value(series, "ray_pp_runtime_queue_depth") == 0
