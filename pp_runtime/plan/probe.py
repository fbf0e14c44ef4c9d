"""One probe of the plan: a candidate at one request rate on the simulator, stopped as soon
as its SLO miss is certain, and kept on disk so that no probe is ever simulated twice.

Rates sit on one grid per GPU for every candidate, `rate(k) = STEP ** k` req/s/GPU, so two
searches that reach the same capacity reach the same number (the fast and the exhaustive
path compare exactly). A probe simulates one replica at its share of the rate, with
arrivals spanning at least SPAN_TTFTS TTFT SLOs (a sustained rate, not a burst).

Early stop (`Watch`): p99 over n values (numpy's linear interpolation) exceeds x once
n - floor(0.99 (n - 1)) of them exceed x. n is known before the run (one TTFT per request,
at most one gap per output token), so the run stops when that many requests are past
their TTFT deadline without a first token (or got it late), or that many token gaps
exceed the TBT SLO: the answer ("misses") is the one the full run would give.

The cache (`ProbeCache`): one JSON file per probe, keyed by the probe's whole config
(layout, knobs, workload with its rate and length), the SLOs it was judged by, and a
fingerprint of the code and the profile that price it; a second identical search reads
every answer back.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from pathlib import Path

from pp_runtime.bench.capacity import Probe, meets
from pp_runtime.config import Config
from pp_runtime.plan.space import cost_model

STEP = 1.05  # rate grid: one step is the search's resolution (5 %)
SPAN_TTFTS = 10  # a probe's arrivals span at least this many TTFT SLOs
MAX_REQUESTS = 5000  # and no probe simulates more requests than this
CODE = ("core", "config", "planner", "costmodel", "engine", "executors/sim.py", "telemetry",
        "plan/probe.py")  # what a probe's answer depends on (the cache's fingerprint)


def rate(k: int) -> float:
    """Grid point k: req/s per GPU."""
    return STEP ** k


def grid_index(per_gpu: float) -> int:
    """The highest grid point at or below per_gpu (a hair of slack for float error)."""
    return math.floor(math.log(per_gpu) / math.log(STEP) + 1e-9)


@dataclass(frozen=True)
class Slo:
    ttft_s: float  # p99 time to first token
    tbt_s: float  # p99 time between tokens


class ClearMiss(Exception):
    """Raised by `Watch` inside the simulation: the probe misses whatever comes next.
    served_qps: the requests per second the run worked at (`Watch.served`: where to look next);
    certain_at: when the miss became certain, a share of the last arrival's time (near 1 or
    more: only the end of the arrivals missed, the rate sits just above the capacity)."""

    def __init__(self, what: str, served_qps: float, certain_at: float = 0.0):
        super().__init__(what)
        self.served_qps, self.certain_at = served_qps, certain_at


def _need(n: int) -> int:
    """Values above x that put numpy's p99 of n values above x."""
    return n - math.floor(0.99 * (n - 1))


class Watch:
    """Stops a simulation whose p99 TTFT or p99 TBT miss is certain (module docstring)."""

    def __init__(self, slo: Slo, num_requests: int, num_tokens: int, mean_tokens: float = 0.0,
                 arrivals: list[float] | None = None):
        self.slo, self.mean_tokens = slo, mean_tokens
        self.need_ttft, self.need_tbt = _need(num_requests), _need(max(1, num_tokens))
        self.next = self.late = self.gap = self.slow = 0
        self.times: list[float] = []  # when each micro-batch came back
        self.done: list[int] = []  # tokens computed until then
        # each request's TTFT deadline, in arrival order (the same float sums as
        # arrival_s + ttft_s); None: read from the requests as they pass
        self.deadlines = None if arrivals is None else [a + slo.ttft_s for a in arrivals]

    def __call__(self, rec, requests, now: float) -> None:
        ttft = self.slo.ttft_s
        self.times.append(now)
        if hasattr(rec, "tokens_done"):  # a ProbeRecorder counts its tokens and slow gaps
            self.done.append(rec.tokens_done)
            self.slow = rec.slow
        else:
            self.done.append((self.done[-1] if self.done else 0) + rec.last_tokens)
            gaps, tbt = rec.token_gaps_s, self.slo.tbt_s
            self.slow += sum(g > tbt for g in gaps[self.gap:])
            self.gap = len(gaps)
        deadlines, i = self.deadlines, self.next
        if deadlines is not None and len(deadlines) == len(requests):
            n = len(deadlines)
            while i < n and deadlines[i] < now:
                r = requests[i]  # its deadline passed: on time or not is settled
                self.late += r.first_token_s is None or r.first_token_s - r.arrival_s > ttft
                i += 1
        else:
            while i < len(requests) and requests[i].arrival_s + ttft < now:
                r = requests[i]
                self.late += r.first_token_s is None or r.first_token_s - r.arrival_s > ttft
                i += 1
        self.next = i
        if self.late >= self.need_ttft or self.slow >= self.need_tbt:
            what = (f"p99 TTFT > {ttft:g} s" if self.late >= self.need_ttft else
                    f"p99 TBT > {self.slo.tbt_s * 1e3:.0f} ms")
            last = requests[-1].arrival_s if requests else 0.0
            raise ClearMiss(f"{what} certain at {now:.0f} s of the run", self.served(now),
                            now / last if last > 0 else 0.0)

    def served(self, now: float) -> float:
        """Requests per second the replica worked at in the second half of the run so far:
        the tokens its micro-batches computed then / the workload's mean tokens per request
        (a run that misses is behind, so this is near what it can carry; the first half,
        which fills an empty pipeline, is left out). 0 where unknown."""
        half = now / 2
        i = bisect.bisect_right(self.times, half)
        if not self.mean_tokens or i == len(self.times):
            return 0.0
        before = self.done[i - 1] if i else 0
        return (self.done[-1] - before) / self.mean_tokens / (now - half)


@lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """sha256 of the package sources a probe's answer depends on (CODE)."""
    root, h = Path(__file__).resolve().parents[1], hashlib.sha256()
    for part in CODE:
        p = root / part
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=None)
def _profile_stamp(profile: str | None) -> str:
    if not profile:
        return ""
    files = sorted(Path(profile).expanduser().glob("*"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file())


class ProbeCache:
    """Probe answers on disk (module docstring); root None: nothing kept."""

    def __init__(self, root: str | Path | None):
        self.root = Path(root) if root else None
        self.simulated = 0  # probes this process ran on the simulator (not read back)
        self.asked = 0  # probes asked for (simulated or read back)

    def key(self, cfg: Config, slo: Slo, replicas: int = 1) -> str:
        """The probe's config as the simulation sees it (`as_run`) and SLOs (what "ok" and
        the early stop were judged by), the code and the profile; on this machine's CPU the
        replicas beside it (they price its compute: `space.cost_model`)."""
        beside = replicas if cfg.hardware.gpu == "cpu" else 1
        text = json.dumps([as_run(cfg).to_dict(), [slo.ttft_s, slo.tbt_s], code_fingerprint(),
                           _profile_stamp(cfg.hardware.profile)] + ([beside] if beside > 1 else []),
                          sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        if self.root is None or not (f := self.root / f"{key}.json").is_file():
            return None
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):  # a torn or foreign file: probe again
            return None

    def put(self, key: str, value: dict) -> None:
        if self.root is None:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, self.root / f"{key}.json")  # atomic: workers share the directory


def as_run(cfg: Config) -> Config:
    """cfg as far as its simulation can tell: `uniform` caps its prompt chunks at the cost
    model's knee (planner/uniform.py: `top`, planner/budget.py: `knee`) and reads the chunk
    size nowhere else, so a chunk size past the knee runs as the knee. Two candidates
    that differ only there (C 1024 and 2048 with the same B) share their probes."""
    pl = cfg.planner
    if pl.planner != "uniform" or not pl.chunk_size:
        return cfg
    top = _knee(cost_model(cfg), pl.tile_size)
    return replace(cfg, planner=replace(pl, chunk_size=top)) if pl.chunk_size > top else cfg


@lru_cache(maxsize=None)
def _knee(cost, tile: int) -> int:
    from pp_runtime.planner.budget import knee

    return knee(cost, tile)[0]


def probe_config(cfg: Config, replicas: int, per_gpu: float, slo: Slo) -> Config:
    """One replica's config at its share of `per_gpu` x the layout's GPUs, its arrivals
    spanning at least SPAN_TTFTS TTFT SLOs."""
    gpus = cfg.parallel.tp * cfg.parallel.pp  # one replica's
    wl = replace(cfg.workload, qps=round(per_gpu * gpus, 9))
    span = math.ceil(wl.qps * SPAN_TTFTS * slo.ttft_s)
    if wl.kind != "trace" and span > wl.num_requests:
        wl = replace(wl, num_requests=min(span, MAX_REQUESTS))
    return replace(cfg, workload=wl)


def simulate_probe(one: Config, cost, slo: Slo, replicas: int, stop_early: bool) -> dict:
    """The probe's answer as plain data: ok, the latencies, bubbles; or the certain miss;
    and the requests one replica finished per second (served_qps)."""
    from pp_runtime.core.workload import generate
    from pp_runtime.engine.simulate import simulate
    from pp_runtime.plan.record import ProbeRecorder, summary

    watch = None
    if stop_early:
        specs = generate(one.workload)
        watch = Watch(slo, len(specs), sum(s.output_len for s in specs),
                      sum(s.prompt_len + s.output_len for s in specs) / len(specs),
                      [s.arrival_s for s in specs])
    try:
        s = summary(simulate(one, cost, progress=False, watch=watch,
                             recorder=partial(ProbeRecorder, slow_above=slo.tbt_s)))
    except ClearMiss as miss:
        return {"ok": False, "stopped": str(miss), "tbt_p99_s": None, "ttft_p99_s": None,
                "served_qps": miss.served_qps, "certain_at": round(miss.certain_at, 6)}
    tbt, ttft = s["tbt_s"]["p99"], s["ttft_s"]["p99"]
    failed = s["num_requests"] - s["finish_reasons"].get("length", 0)
    ok = meets(tbt, ttft, slo.tbt_s, slo.ttft_s, failed)
    end = {}
    if watch is not None and not ok:  # a miss certain only at its end (`ClearMiss.certain_at`)
        end = {"certain_at": round(s["makespan_s"] / specs[-1].arrival_s, 6) if specs[-1].arrival_s > 0 else 0.0}
    return {"ok": ok, **end, "tbt_p99_s": tbt,
            "ttft_p99_s": ttft, "failed": failed, "bubble_fraction": s["bubble_fraction"],
            "bubble_by_cause": s["bubble_fraction_by_cause"],
            "throughput_tok_s": s["throughput_tok_s"] * replicas,
            "num_requests": s["num_requests"],
            "served_qps": s["num_requests"] / s["makespan_s"] if s["makespan_s"] else 0.0}


class Prober:
    """probe(k) -> Probe of one candidate at grid point k (all replicas' rate in Probe.qps),
    read back from the cache or simulated (stopped early on a certain miss if asked)."""

    def __init__(self, cfg: Config, replicas: int, slo: Slo, cache: ProbeCache, stop_early: bool):
        self.cfg, self.replicas, self.slo, self.cache = cfg, replicas, slo, cache
        self.stop_early = stop_early
        self.gpus = replicas * cfg.parallel.tp * cfg.parallel.pp

    def __call__(self, k: int) -> Probe:
        one = probe_config(self.cfg, self.replicas, rate(k), self.slo)
        key = self.cache.key(one, self.slo, self.replicas)
        got = self.cache.get(key)
        self.cache.asked += 1
        if got is None or (got.get("stopped") and not self.stop_early):
            got = simulate_probe(one, cost_model(self.cfg, self.replicas), self.slo, self.replicas,
                                 self.stop_early)
            self.cache.simulated += 1
            self.cache.put(key, got)
        return Probe(rate(k) * self.gpus, got["tbt_p99_s"], got["ttft_p99_s"], got["ok"],
                     {**got, "k": k})
