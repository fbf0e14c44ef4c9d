"""benchmarks/goodput.py's rate ceiling and probe length, by hand on a toy cost model: the
SLO ceiling (`slo_bound`), the requests a probe holds (`Setting.requests_at`), and the
rates it probes (up to the work bound, not the offline throughput)."""
import argparse
import json
import math

import pytest
from benchmarks_loader import load_benchmark

goodput = load_benchmark("goodput")


class Affine:
    """Each of `stages` stages: W seconds a micro-batch, C per token, A per key a decode reads."""

    W, C, A = 2e-3, 1e-5, 1e-8

    def __init__(self, stages: int = 4, slow_last: float = 1.0):
        self.stages, self.slow_last = stages, slow_last

    def stage_times(self, prefills, decodes):
        tokens = sum(n for _, n in prefills) + len(decodes)
        t = self.W + self.C * tokens + self.A * sum(decodes)
        return [t] * (self.stages - 1) + [t * self.slow_last]


def test_the_slo_ceiling_is_the_largest_micro_batch_in_a_share_of_the_target():
    wl = goodput.Workload(tokens=1000.0, keys=50_000.0)
    tbt, pp = 0.048, 4  # a 12 ms share each: n* = (12 ms - W) / C = 1000 tokens
    n = math.floor((tbt / pp - Affine.W) / Affine.C + 1e-9)
    assert n == 1000
    # the keys' price is a decode's seconds per key: stage_times([], [1025]) - ([], [1]), / 1024
    per_request = (Affine.W + Affine.C * n) / n * wl.tokens + Affine.A * wl.keys
    assert goodput.slo_bound(Affine(pp), wl, pp, tbt) == pytest.approx(1 / per_request, rel=1e-9)
    # the slowest stage bounds it: twice the time on the last stage, so n* is what fits in
    # half the share there (400 tokens), and that stage's time per token prices it
    slow = Affine(pp, slow_last=2.0)
    n2 = math.floor((tbt / pp / 2 - Affine.W) / Affine.C + 1e-9)
    per_request2 = 2 * ((Affine.W + Affine.C * n2) / n2 * wl.tokens + Affine.A * wl.keys)
    assert goodput.slo_bound(slow, wl, pp, tbt) == pytest.approx(1 / per_request2, rel=1e-9)
    # a target whose share holds no token: nothing is carried
    assert goodput.slo_bound(Affine(pp), wl, pp, pp * Affine.W / 2) == 0.0


def test_a_probe_spans_a_request_s_life_at_the_loosest_target():
    st = goodput.Setting.__new__(goodput.Setting)  # the two fields requests_at reads
    st.requests, st.life_s = 400, 72.6
    assert st.requests_at(None) == 400  # offline: every request at once, N
    assert st.requests_at(2.0) == 400  # 145.2 requests' worth of arrivals: N is more
    assert st.requests_at(43.436) == math.ceil(43.436 * 72.6) == 3154


def test_rates_are_probed_up_to_the_work_bound_not_the_offline_throughput():
    st = goodput.Setting("paper/llama2_70b_tp8_pp8_h100", 400, 1.0, goodput.tqdm(disable=True))
    top = goodput.RATE0 * goodput.GRID_STEP ** st.top
    assert top <= st.bound < top * goodput.GRID_STEP  # the highest grid rate under the bound
    assert st.bound > 40  # req/s: LLaMA-2-70B P:D 1's work bound, ~4x its offline rate (11.7)
    # a request's life at 5x the unloaded time between tokens
    assert st.life_s == pytest.approx(st.mean_output * 5 * st.tbt_unloaded)


def test_a_capacity_is_bisected_between_its_grid_rate_and_the_next():
    """A toy setting whose probes meet the targets up to 1.06 x the grid rate q: the grid
    says q; two bisections on a log scale try q x 1.1^(1/2) (met) and q x 1.1^(3/4) (missed)
    and give q x 1.1^(1/2); none gives q; past the work bound it is not probed."""
    st = goodput.Setting.__new__(goodput.Setting)
    q, probed = 2.0, []
    st.bound, st.runs = 100.0, {}
    st.run = lambda planner, knobs, qps: probed.append(qps) or {"qps": qps}
    st.ok = lambda r, slo: r["qps"] <= 1.06 * q
    assert st.refine("uniform", {}, 0.1, q)[0] == pytest.approx(q * 1.1 ** 0.5, rel=1e-6)
    assert probed[:2] == pytest.approx([q * 1.1 ** 0.5, q * 1.1 ** 0.75], rel=1e-6)
    goodput.REFINE, probed[:] = 0, []
    try:
        assert st.refine("uniform", {}, 0.1, q)[0] == q and probed == [q]
    finally:
        goodput.REFINE = 2
    st.bound = 2.05  # the next grid rate (2.2) is past the bound: bisect towards the bound
    assert st.refine("uniform", {}, 0.1, q)[0] == pytest.approx(math.sqrt(math.sqrt(q * 2.05) * 2.05), rel=1e-6)


def test_anchors_read_from_an_earlier_run_give_the_same_table(tmp_path, monkeypatch):
    """A setting run once, then again with its probes known (`--anchors-from`): the same
    cells and offline rows, with only `uniform`'s probes simulated; an earlier run on other
    anchor code is refused in one line, naming both fingerprints."""
    monkeypatch.setattr(goodput, "pareto", lambda *a: None)
    first = goodput.run_setting("tiny", 3, 20, False, tmp_path, refine=0)
    uniform = sum(json_key.startswith('["uniform"') for json_key in first["runs"])
    again = goodput.run_setting("tiny", 3, 20, False, tmp_path, refine=0,
                                known={first["setting"]: first["runs"]})
    assert again["cells"] == first["cells"] and again["offline"] == first["offline"]
    assert first["simulations"] == len(first["runs"]) and again["simulations"] == uniform
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps([{**first, "anchor_code": "0" * 16}], default=str))
    with pytest.raises(SystemExit):
        goodput.anchors_from(argparse.ArgumentParser(), str(path))
    path.write_text(json.dumps([first], default=str))
    assert goodput.anchors_from(argparse.ArgumentParser(), str(path)) == {
        first["setting"]: json.loads(json.dumps(first["runs"], default=str))}


def test_uniform_is_probed_at_each_anchor_frontier_point_it_does_not_match():
    """The frontier check by hand: Sarathi-Serve's frontier (13, 20, 30 ms) and gLLM's (11,
    16, 40 ms; 11 is under the table's tightest target, 2 x 6 ms) against `uniform`'s one
    point (25 ms, 150 tok/s): it is probed with 20, 30 and 16 ms as its targets (13 ms is
    under its floor: its one-line error, skipped), not 40 ms (150 >= 50 already); it
    carries 120 >= 100 at 20 ms, 250 < 300 at 30 ms and meets no rate at 16 ms, so its
    frontier is at or above 2 of the 5 points."""
    from types import SimpleNamespace

    from pp_runtime.config import ConfigError

    fr = load_benchmark("goodput_frontier")
    st = SimpleNamespace(ttft_slo=1.0, tbt_unloaded=0.006, multiples=(2, 3, 5), runs={})

    def add(planner, tbt, thr, ttft=0.5):
        st.runs[json.dumps([planner, {"tbt": tbt}, 1.0])] = {
            "qps": 1.0, "tbt_p99": tbt, "throughput_tok_s": thr, "ttft_p99": ttft, "failed": 0}

    for tbt, thr in ((0.013, 40), (0.02, 100), (0.03, 300), (0.05, 200)):
        add("sarathi-serve", tbt, thr)
    add("sarathi-serve", 0.04, 900, ttft=2.0)  # missed the TTFT target: on no frontier
    add("gllm", 0.011, 10)
    add("gllm", 0.04, 50)
    add("uniform", 0.025, 150)
    add("gllm", 0.016, 30)  # uniform meets no rate at 16 ms: capacity 0, no refine
    probed, carried = [], {20: (0.018, 120), 30: (0.028, 250)}

    def capacity(planner, knobs, slo):
        if knobs["tbt_slo_ms"] < 15:
            raise ConfigError("planner.tbt_slo_ms: below one decode through the pipeline")
        probed.append(round(knobs["tbt_slo_ms"]))
        return (0.0 if knobs["tbt_slo_ms"] < 17 else 1.0), None

    def refine(planner, knobs, slo, qps):
        tbt, thr = carried[round(knobs["tbt_slo_ms"])]
        add("uniform", tbt, thr)
        return qps, {"throughput_tok_s": thr, "tbt_p99": tbt}

    st.capacity = capacity
    rows = fr.check(st, refine)
    assert probed == [20, 30, 16]
    assert [(r["anchor"], r["tbt_p99"], r["uniform_tok_s"]) for r in rows] == [
        ("sarathi-serve", 0.02, 120), ("sarathi-serve", 0.03, 250), ("gllm", 0.016, 0.0)]
    line = fr.summary(st, rows)
    assert line.startswith("frontier: uniform at or above 2 of the anchors' 5 frontier points at p99 TBT >= 12.0 ms")
    assert "sarathi-serve 13.0 ms (0 < 40 tok/s)" in line and "sarathi-serve 30.0 ms (250 < 300 tok/s)" in line
