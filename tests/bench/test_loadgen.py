"""The load generator and the capacity search (pp_runtime/bench/loadgen.py, bench/capacity.py).

Percentiles, TBT and SLO attainment against numbers worked out by hand; the SSE client
against a small aiohttp server that streams on a known schedule (and answers 429); the
capacity search on synthetic monotone latency curves with a known threshold; the
simulator's capacity search on the tiny config; and one run against a real
`pp-runtime serve` subprocess on 127.0.0.1 (a tiny checkpoint, two in-process stages).
"""
import asyncio
import json
import subprocess
import sys
import threading

import pytest

from pp_runtime.bench.capacity import Probe, capacity_search, meets, poisson_specs, sim_probe
from pp_runtime.config import load_config
from pp_runtime.bench.loadgen import (LATENCY_KEYS, RequestResult, ServerUnreachable, load_test,
                                      slo_attainment, stats, summarize)
from pp_runtime.core.workload import RequestSpec, workload_prompts
from pp_runtime.core.net import free_port


def result(i, sent, times, finish="length", **kw):
    return RequestResult(i, 4, len(times), sent, sent_s=sent, token_times_s=list(times),
                         finish_reason=finish, status=200, **kw)


# ---- figures, by hand --------------------------------------------------------------------
def test_percentiles_interpolate_linearly():
    # 1..10: rank p/100 * 9 -> p50 = 5.5, p90 = 9.1, p99 = 9.91
    assert stats(range(1, 11), LATENCY_KEYS) == pytest.approx({"median": 5.5, "p90": 9.1, "p99": 9.91})
    assert stats([], LATENCY_KEYS) == {"median": None, "p90": None, "p99": None}
    assert stats([3.0], LATENCY_KEYS) == {"median": 3.0, "p90": 3.0, "p99": 3.0}


def test_ttft_tbt_and_slo_attainment_by_hand():
    a = result(0, 0.0, [0.5, 0.6, 0.7, 0.8])      # TTFT 0.5, gaps 0.1 0.1 0.1
    b = result(1, 1.0, [1.2, 1.3, 2.3])            # TTFT 0.2, gaps 0.1 1.0 (p99 0.991)
    c = result(2, 2.0, [4.0])                      # TTFT 2.0, no gap
    d = RequestResult(3, 4, 4, 3.0, sent_s=3.0, status=429, error="HTTP 429")
    assert a.ttft_s == pytest.approx(0.5) and b.tbt_s == pytest.approx([0.1, 1.0])
    att = slo_attainment([a, b, c, d], ttft_slo=1.0, tbt_slo=0.5)
    # TTFT <= 1: a, b (c is 2 s late, d failed); p99 TBT <= 0.5: a, c (b's is 0.991)
    assert att == {"ttft": 0.5, "tbt": 0.5, "both": 0.25}
    assert slo_attainment([a, b, c, d], None, None) == {"ttft": None, "tbt": None, "both": None}

    s = summarize([a, b, c, d], wall_s=4.0, ttft_slo=1.0, tbt_slo=0.5)
    assert (s["num_requests"], s["completed"], s["failed"], s["rejected"]) == (4, 3, 1, 1)
    assert s["output_tokens"] == 8 and s["output_tok_s"] == pytest.approx(2.0)
    assert s["requests_s"] == pytest.approx(0.75)
    # TTFTs 0.5, 0.2, 2.0 -> p50 0.5; gaps 0.1 x4, 1.0 -> p50 0.1, p90 0.64, p99 0.964
    assert s["ttft_s"]["median"] == pytest.approx(0.5)
    assert [s["tbt_s"][k] for k in LATENCY_KEYS] == pytest.approx([0.1, 0.64, 0.964])


def test_tokens_of_one_event_share_its_arrival():
    from pp_runtime.bench.loadgen import _consume_event

    r = RequestResult(0, 3, 4, 0.0, sent_s=0.0)
    ev = lambda ids, fin=None: json.dumps({"choices": [{"index": 0, "text": "", "token_ids": ids,  # noqa: E731
                                                        "finish_reason": fin}]})
    assert not _consume_event(r, ev([5]), 0.3)
    assert not _consume_event(r, ev([6, 7]), 0.5)
    assert not _consume_event(r, ev([8], "length"), 0.6)
    assert _consume_event(r, "[DONE]", 0.6)
    assert r.token_ids == [5, 6, 7, 8] and r.tbt_s == pytest.approx([0.2, 0.0, 0.1])
    assert r.ok and r.finish_reason == "length"


def test_prompts_follow_run_workloads_rule():
    import random

    specs = [RequestSpec(0.0, 3, 2), RequestSpec(0.1, 2, 2)]
    rng = random.Random(7)
    assert workload_prompts(specs, 50, 7) == [[rng.randrange(50) for _ in range(n)] for n in (3, 2)]


@pytest.mark.parametrize("seed", [0, 7])
def test_offline_and_http_send_the_same_prompts(seed):
    """One rule for a workload's prompts: `run_workload`'s requests (offline) and the load
    generator's / capacity search's (over HTTP) are the same token ids for the same seed."""
    from pp_runtime.engine.llm import workload_requests
    from pp_runtime.core.workload import generate

    cfg = load_config("tiny", **{"workload.seed": seed, "workload.num_requests": 5})
    specs, offline, _ = workload_requests(cfg)
    assert offline == workload_prompts(generate(cfg.workload), cfg.model.vocab_size, seed)
    assert [len(p) for p in offline] == [s.prompt_len for s in specs]
    other = load_config("tiny", **{"workload.seed": seed + 1, "workload.num_requests": 5})
    assert workload_requests(other)[1] != offline  # the seed matters


# ---- the client against a fake streaming server -------------------------------------------
GAP_S = 0.05


def fake_server(first_s=None):
    """An aiohttp app in a thread: /v1/models, and /v1/completions streaming max_tokens
    tokens one event each, GAP_S apart (the first after `first_s(max_tokens)` when given),
    or 429 when max_tokens == 99. Yields its URL."""
    from aiohttp import web

    async def models(_):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        if body["max_tokens"] == 99:
            return web.json_response({"error": {"message": "queue full"}}, status=429)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for k in range(n):
            await asyncio.sleep(first_s(n) if k == 0 and first_s else GAP_S)
            chunk = {"choices": [{"index": 0, "text": str(k), "token_ids": [k],
                                  "finish_reason": "length" if k == n - 1 else None}]}
            if k == n - 1:
                chunk["pp_runtime"] = {"queue_s": 0.0, "ttft_s": GAP_S, "generation_s": n * GAP_S,
                                       "bubble_s": 0.01}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    loop, started = asyncio.new_event_loop(), threading.Event()
    port = free_port()

    def serve():
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait(10)
    return f"http://127.0.0.1:{port}", lambda: (loop.call_soon_threadsafe(loop.stop), thread.join(10))


def test_client_times_every_streamed_token_and_counts_rejections():
    url, stop = fake_server()
    try:
        specs = [RequestSpec(0.0, 2, 5), RequestSpec(0.1, 2, 3), RequestSpec(0.1, 2, 99)]
        s, results = load_test(url + "/v1", specs, [[1, 2]] * 3, ttft_slo=1.0, tbt_slo=0.5,
                               progress=False)
    finally:
        stop()
    a, b, c = results
    assert a.token_ids == [0, 1, 2, 3, 4] and b.token_ids == [0, 1, 2]
    assert a.finish_reason == "length" and a.server_timing["bubble_s"] == 0.01
    assert all(GAP_S * 0.8 < g < GAP_S * 6 for g in a.tbt_s + b.tbt_s), a.tbt_s + b.tbt_s
    assert b.sent_s >= 0.1 and GAP_S * 0.8 < b.ttft_s < GAP_S * 6
    assert c.status == 429 and not c.ok and "queue full" in c.error
    assert (s["completed"], s["failed"], s["rejected"], s["output_tokens"]) == (2, 1, 1, 8)
    assert s["slo_attainment"]["both"] == pytest.approx(2 / 3)
    assert s["server_median"]["bubble_s"] == 0.01


def test_server_probe_bounds_the_median_or_the_p99_ttft():
    """A server whose first token takes 20 ms per requested token: the median and the p99
    TTFT of one load differ, and `ttft_key` picks which one the SLO bounds (between the
    two: met on the median, missed on the p99)."""
    from pp_runtime.bench.capacity import server_probe

    url, stop = fake_server(first_s=lambda n: 0.02 * n)
    cfg = load_config("tiny", **{"workload.num_requests": 8, "workload.min_len": 8,
                                 "workload.max_len": 40, "workload.pd_ratio": 1})
    try:
        first = server_probe(url + "/v1", cfg, 10.0, 100.0, progress=False)(50.0)
        ttft = first.detail["ttft_s"]
        assert first.ttft_p50_s == ttft["median"] and ttft["p99"] > 1.2 * ttft["median"], ttft
        slo = (ttft["median"] + ttft["p99"]) / 2
        median = server_probe(url + "/v1", cfg, 10.0, slo, progress=False)(50.0)
        p99 = server_probe(url + "/v1", cfg, 10.0, slo, progress=False, ttft_key="p99")(50.0)
    finally:
        stop()
    assert p99.ttft_p50_s == p99.detail["ttft_s"]["p99"]
    assert median.ok and not p99.ok, (median, p99)


def test_unreachable_server_is_one_line_and_exit_2():
    port = free_port()  # nothing listens there
    with pytest.raises(ServerUnreachable, match=f"127.0.0.1:{port}"):
        load_test(f"http://127.0.0.1:{port}", [RequestSpec(0.0, 2, 2)], [[1, 2]], progress=False)
    r = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "bench", "serve", "--url",
                        f"http://127.0.0.1:{port}", "--config", "tiny", "--requests", "2", "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and f"http://127.0.0.1:{port}" in r.stderr, r.stderr


# ---- capacity search ---------------------------------------------------------------------
def synthetic(threshold: float, slo: float = 0.1):
    """p99 TBT rising with the rate, crossing the SLO exactly at `threshold` QPS."""
    def probe(q):
        tbt = slo * (q / threshold) ** 2
        return Probe(q, tbt, 0.01, meets(tbt, 0.01, slo, None))
    return probe


@pytest.mark.parametrize("threshold,start", [(3.7, 1.0), (3.7, 20.0), (0.15, 1.0), (40.0, 0.5)])
def test_capacity_search_finds_a_known_threshold(threshold, start):
    cap = capacity_search(synthetic(threshold), start, rel_tol=0.05, max_probes=20)
    assert threshold / 1.05 <= cap.qps <= threshold, cap
    assert all(p.ok == (p.qps <= threshold) for p in cap.probes)
    assert [p.qps for p in cap.curve] == sorted(p.qps for p in cap.probes)


def test_capacity_search_respects_its_probe_budget_and_reports_zero():
    cap = capacity_search(synthetic(3.7), 1.0, rel_tol=1e-9, max_probes=5)
    assert len(cap.probes) == 5 and 0 < cap.qps <= 3.7
    never = capacity_search(lambda q: Probe(q, 1.0, 0.0, False), 1.0, max_probes=4)
    assert never.qps == 0.0 and [p.qps for p in never.probes] == [1.0, 0.5, 0.25, 0.125]
    floor = capacity_search(lambda q: Probe(q, 1.0, 0.0, False), 1.0, max_probes=9, min_qps=0.3)
    assert floor.qps == 0.0 and [p.qps for p in floor.probes] == [1.0, 0.5]  # 0.25 < min_qps


def test_the_ttft_slo_bounds_capacity_too():
    assert meets(0.05, 0.5, tbt_slo=0.1, ttft_slo=1.0)
    assert not meets(0.05, 2.0, tbt_slo=0.1, ttft_slo=1.0)
    assert not meets(0.05, 0.5, tbt_slo=0.1, ttft_slo=1.0, failed=1)
    assert not meets(None, 0.5, tbt_slo=0.1, ttft_slo=None)


def test_probes_share_lengths_and_scale_arrivals():
    cfg = load_config("tiny", **{"workload.num_requests": 20})
    a, b = poisson_specs(cfg, 1.0), poisson_specs(cfg, 4.0)
    assert [(s.prompt_len, s.output_len) for s in a] == [(s.prompt_len, s.output_len) for s in b]
    assert [s.arrival_s / 4 for s in a] == pytest.approx([s.arrival_s for s in b])


def test_simulator_capacity_search_on_the_tiny_config():
    cfg = load_config("tiny", **{"workload.num_requests": 30})
    # the tiny model on the simulated A100 takes microseconds: SLOs relative to a light load
    light = sim_probe(cfg, tbt_slo=1.0, ttft_slo=None)(100.0)
    tbt_slo, ttft_slo = 1.5 * light.tbt_p99_s, 3 * light.ttft_p50_s
    cap = capacity_search(sim_probe(cfg, tbt_slo, ttft_slo), start=1000.0, rel_tol=0.1,
                          max_probes=12, max_qps=1e8)
    assert cap.qps > 1000 and any(not p.ok for p in cap.probes), cap.probes
    for p in cap.probes:
        assert p.ok == (p.tbt_p99_s <= tbt_slo and p.ttft_p50_s <= ttft_slo)
    above = [p for p in cap.probes if p.qps > cap.qps]
    assert above and min(p.qps for p in above) <= cap.qps * 1.1 + 1e-9  # bracketed to 10 %
    curve = cap.curve  # queueing grows with the rate
    assert curve[0].ttft_p50_s <= curve[-1].ttft_p50_s


@pytest.mark.parametrize("key", ["median", "p99"])
def test_bench_serve_capacity_on_the_simulator_bounds_the_ttft_it_is_given(tmp_path, key):
    """`pp-runtime bench serve --capacity --simulate --ttft-key`: each probe holds the TTFT
    the key names (its p99, with p99), and the output and capacity.json say which."""
    r = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "bench", "serve", "--simulate",
                        "--capacity", "--config", "tiny", "--requests", "20", "--tbt-slo", "1",
                        "--ttft-slo", "1", "--ttft-key", key, "--max-probes", "2", "--quiet",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    label = "p50" if key == "median" else "p99"
    assert f"{key} TTFT <= 1000 ms" in r.stdout and f"{label} TTFT" in r.stdout, r.stdout
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["ttft_key"] == key and len(saved["probes"]) == 2
    held = [(p["ttft_p50_s"], p["detail"]["ttft_p99_s"]) for p in saved["probes"]]
    if key == "p99":
        assert all(a == b for a, b in held), held
    else:  # the median: below the p99 where requests queue
        assert all(a <= b for a, b in held) and any(a < b for a, b in held), held


# ---- a real server -----------------------------------------------------------------------
@pytest.fixture
def tiny_server(tmp_path):
    pytest.importorskip("pp_runtime.serve", reason="pp-runtime serve is not there yet")
    from conftest import hf_model

    from pp_runtime.bench.capacity import ServerProcess

    ckpt = tmp_path / "ckpt"
    hf_model("gpt").save_pretrained(ckpt)
    # two pipeline stages in the server's process (the Ray deployment has its own tests),
    # cut by `auto` (chosen where the server builds its executor)
    with ServerProcess(["--checkpoint", str(ckpt), "--set", "pp=2", "--set", "executor=local",
                        "--set", "layer_split=auto",
                        "--set", "threads_per_worker=1", "--set", "chunk_size=32", "--set", "max_batch_size=4",
                        "--set", "tile_size=32"],
                       free_port(), tmp_path / "server.log", ready_timeout_s=240) as server:
        yield server


def test_load_against_a_real_pp2_server(tiny_server):
    cfg = load_config("tiny", **{"workload.num_requests": 8, "workload.min_len": 8,
                                 "workload.max_len": 60, "workload.pd_ratio": 3})
    specs = poisson_specs(cfg, 4.0)
    prompts = workload_prompts(specs, 300, cfg.workload.seed)  # the checkpoint's vocabulary
    s, results = load_test(tiny_server.url, specs, prompts, ttft_slo=30.0, tbt_slo=30.0,
                           progress=False)
    assert s["completed"] == 8 and s["failed"] == 0, [r.error for r in results]
    assert [len(r.token_ids) for r in results] == [sp.output_len for sp in specs]
    assert s["slo_attainment"] == {"ttft": 1.0, "tbt": 1.0, "both": 1.0}
    assert s["tbt_s"]["p99"] > 0 and s["output_tok_s"] > 0
    assert set(results[0].server_timing) >= {"queue_s", "ttft_s", "generation_s", "bubble_s"}


@pytest.mark.parametrize("key", ["median", "p99"])
def test_the_latency_figure_names_the_ttft_its_probes_hold(key):
    from pp_runtime.bench.capacity import latency_figure

    probes = [Probe(0.5, 0.2, 1.0, True), Probe(1.0, 0.4, 3.0, False)]
    fig = latency_figure({"uniform (server)": probes}, 0.3, 2.0, ttft_key=key)
    tbt, ttft = fig.axes
    assert tbt.get_title().startswith("p99 TBT") and ttft.get_title() == f"{key} TTFT"
    assert ttft.get_ylabel() == f"{key} TTFT (s)"
    assert list(ttft.lines[0].get_ydata()) == [1.0, 3.0]
