"""benchmarks/faults.py's bookkeeping, without a server: the request sequence, a stream's
problems (a duplicate, a gap, other tokens), the outage after a fault, the TBT gaps left
out, /health's way back, and the checks' verdicts on made-up runs."""
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("psutil")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"


def _load():
    env = dict(os.environ)
    spec = importlib.util.spec_from_file_location("faults", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    os.environ.clear()
    os.environ.update(env)  # its RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER stays out of other tests
    return mod


faults = _load()
Req = faults.Req


def req(ids, k=0, prompt=0, max_tokens=None, times=None, **kw):
    """A streamed request: one chunk per token, text as the server writes it."""
    times = times or [float(i) for i in range(len(ids))]
    chunks = [(t, [x], (" " if i else "") + str(x)) for i, (t, x) in enumerate(zip(times, ids))]
    return Req(k, prompt, len(ids) if max_tokens is None else max_tokens, chunks,
               finish=kw.pop("finish", "length"), **kw)


def test_the_sequence_repeats_its_prompts_and_is_the_same_every_run():
    a = [faults.plan(k, 4, 50257, (40, 100)) for k in range(8)]
    assert a == [faults.plan(k, 4, 50257, (40, 100)) for k in range(8)]
    assert a[:4] == a[4:] and len({tuple(x[1]) for x in a[:4]}) == 4
    assert all(16 <= len(x[1]) <= 128 and 40 <= x[2] <= 100 for x in a)


def test_a_whole_stream_has_no_problem():
    ids = [5, 6, 7, 8]
    assert faults.stream_problems(req(ids), ids) == []


@pytest.mark.parametrize("ids, why", [
    ([1, 2, 3, 2, 3, 4], "duplicate of 2 token(s) at index 3"),
    ([1, 2, 3, 5, 6], "gap of 1 token(s) at index 3"),
    ([1, 2, 3, 9, 9, 9], "differs from index 3"),
])
def test_a_duplicate_a_gap_or_other_tokens_are_named_with_where(ids, why):
    ref = [1, 2, 3, 4, 5, 6]
    assert why in faults.diagnose(ids, ref)
    probs = faults.stream_problems(req(ids, max_tokens=6), ref)
    assert any(why in x for x in probs)


def test_a_stream_is_checked_against_itself_too():
    r = req([1, 2, 3], max_tokens=4)
    assert any("3 tokens streamed" in x for x in faults.stream_problems(r, None))
    r = req([1, 2, 3], usage=4)
    assert any("usage 4" in x for x in faults.stream_problems(r, None))
    r = req([1, 2, 3])
    r.chunks[1] = (1.0, [2], " 2 2")  # the text shows a token the ids do not
    assert len(faults.stream_problems(r, None)) == 2
    assert faults.stream_problems(req([1, 2], finish="stop"), None) == ["finish_reason 'stop'"]
    assert faults.stream_problems(req([], error="APIError: x"), [1]) == ["error: APIError: x"]


def test_the_outage_is_the_longest_silence_after_the_fault():
    arrivals = [0.0, 0.5, 1.0, 1.2, 9.0, 9.1, 9.2, 20.0]
    assert faults.service_back(1.1, arrivals, 15.0) == (1.2, 9.0)
    assert faults.service_back(1.1, [0.0, 1.0], 15.0) == (1.0, None)  # no token after it


def test_gaps_overlapping_an_outage_are_left_out():
    r = req([1, 2, 3, 4], times=[0.0, 1.0, 5.0, 5.5])
    assert faults.gaps_outside([r], []) == ([1.0, 4.0, 0.5], 0)
    assert faults.gaps_outside([r], [(2.0, 4.0)]) == ([1.0, 0.5], 1)


def test_health_is_back_at_the_first_200_after_it_went_down():
    h = faults.Health("http://127.0.0.1:1")
    h.samples = [(0.0, 200, "ok"), (1.0, 200, "ok"), (1.2, 503, "recovering"), (1.4, 0, "no answer"),
                 (3.0, 503, "recovering"), (3.2, 200, "ok")]
    assert h.back(0.5) == (3.2, ["recovering", "no answer"])
    assert h.back(3.1) == (None, [])  # never went down after 3.1


def fault_row(n, stage, back, rss):
    return {"n": n, "at_s": 30.0 * n, "stage": stage, "pid": 100 + n, "t": 30.0 * n,
            "health_back": 30.0 * n + back, "statuses": ["recovering"], "rss_mib": rss, "actors": 2,
            "hung_pid_alive": None, "load": 2.0, "others": 0.1, "timeline": [], "silence_from_s": 0.0, "tokens_back_s": back,
            "health_back_s": back, "back_s": back, "all_back_s": back, "window": (30.0 * n, 30.0 * n + back)}


def args(**kw):
    return SimpleNamespace(config="cpu/gpt2_pp2", streams=2, minutes=1.0, hang=False, kill_every=30.0,
                           settle_s=10.0, back_slo=20.0, tbt_tolerance=0.2, mem_tolerance=0.1, pp=2,
                           others=[0.1, 0.2], **kw)


def test_the_checks_pass_a_clean_run_and_name_what_failed():
    ref = [req([1, 2, 3], prompt=0), req([4, 5], prompt=1)]
    run = [req([1, 2, 3], prompt=0), req([4, 5], prompt=1)]
    rows = [fault_row(1, 0, 3.0, 1000.0), fault_row(2, 1, 4.0, 1010.0)]
    metrics = {"pp_runtime_recoveries_total{stage=0}": 1.0, "pp_runtime_recoveries_total{stage=1}": 1.0}
    lines, checks = faults.analyse(ref, run, rows, metrics, 990.0, args())
    assert all(good for _, good in checks), lines
    bad = [req([1, 2, 2], prompt=0), req([4, 5], prompt=1)]
    rows[1].update(back_s=25.0, rss_mib=1200.0)
    metrics = {"pp_runtime_recoveries_total{stage=1}": 2.0}  # the hang blamed on the wrong stage
    lines, checks = faults.analyse(ref, bad, rows, metrics, 990.0, args())
    failed = {name for name, good in checks if not good}
    assert failed == {"every faulty request complete, no duplicate or gap, = fault-free",
                      "every fault injected, service back within 20 s",
                      "memory after the last recovery within 10% of the first",
                      "pp_runtime_recoveries_total by stage = faults by stage"}, lines
    assert any("request 0 (prompt 0, 3 tokens): not the fault-free tokens: duplicate of 1 token(s) at index 2" in x
               for x in lines)


def test_the_outage_lasts_until_every_stream_it_cut_has_its_next_token():
    a = req([1, 2, 3, 4], times=[0.0, 1.0, 6.0, 7.0])  # cut at 1.0, back at 6.0 (the first)
    b = req([1, 2, 3], times=[0.5, 9.0, 9.5])  # cut at 0.5, back at 9.0 (the last)
    c = req([1, 2], times=[8.0, 8.5])  # sent during the outage: its first token is not a return
    fault = faults.Fault(1, 30.0, 0, 123, t=2.0, health_back=5.0)
    (row,) = faults.outages([fault], [a, b, c], end=20.0)
    assert (row["silence_from_s"], row["tokens_back_s"], row["all_back_s"]) == (-1.0, 4.0, 7.0)
    assert row["back_s"] == 4.0 and row["health_back_s"] == 3.0
    assert row["window"] == (1.0, 9.0)


def test_the_killer_notes_each_ray_title_change_during_a_recovery(monkeypatch):
    names = {11: "ray::StageActor", 12: "python -m something"}
    procs = sys.modules["faults_procs"]  # where the Killer looks processes up
    monkeypatch.setattr(procs, "tree", lambda pid: [pid, 11, 12])
    monkeypatch.setattr(procs, "title", lambda pid: names[pid])
    killer = faults.Killer(1, args(), faults.Health("http://127.0.0.1:1"))
    f, titles = faults.Fault(1, 30.0, 0, 10, t=0.0), {}
    killer.watch(f, titles)
    killer.watch(f, titles)  # nothing changed: nothing noted
    names[11] = "ray::stage0-tp0.start"
    killer.watch(f, titles)
    assert [(q, name) for _, q, name in f.timeline] == [(11, "ray::StageActor"), (11, "ray::stage0-tp0.start")]
