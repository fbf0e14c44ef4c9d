"""Workload generators: Zipf lengths with a P:D ratio, fixed, Poisson arrivals, traces."""
import numpy as np
import pytest

from pp_runtime.config import ConfigError
from pp_runtime.core.workload import (RequestSpec, WorkloadConfig, generate, read_trace, split_pd,
                                 write_trace, zipf_lengths)


def test_split_pd_keeps_the_ratio():
    assert split_pd(1100, 10.0) == (1000, 100)
    assert split_pd(4096, 10.0) == (3724, 372)
    assert split_pd(2, 10.0) == (1, 1)  # at least one output token


def test_zipf_lengths_stay_in_range_and_follow_the_law():
    rng = np.random.default_rng(0)
    x = zipf_lengths(200_000, 1024, 4096, 0.4, rng)
    assert x.min() >= 1024 and x.max() <= 4096
    # P(rank r) ~ r^-0.4: the first 10 % of ranks carry (0.1 N)^0.6 / N^0.6 of the mass
    ranks = np.arange(1, 3074) ** -0.4
    expected = ranks[:307].sum() / ranks.sum()
    assert np.mean(x < 1024 + 307) == pytest.approx(expected, abs=0.01)
    assert np.mean(zipf_lengths(100_000, 1, 100, 0.0, rng) <= 50) == pytest.approx(0.5, abs=0.01)


def test_paper_workload_has_pd_10_and_is_reproducible():
    cfg = WorkloadConfig(num_requests=2000, seed=3, min_len=1024, max_len=4096)
    specs = generate(cfg)
    assert specs == generate(cfg)
    p = sum(s.prompt_len for s in specs)
    d = sum(s.output_len for s in specs)
    assert p / d == pytest.approx(10, rel=0.01)
    assert all(1024 <= s.prompt_len + s.output_len <= 4096 for s in specs)
    assert all(s.arrival_s == 0 for s in specs)


def test_poisson_arrivals_have_the_rate():
    specs = generate(WorkloadConfig(kind="fixed", num_requests=5000, qps=4.0))
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals)
    assert len(specs) / arrivals[-1] == pytest.approx(4.0, rel=0.05)
    assert {(s.prompt_len, s.output_len) for s in specs} == {(512, 64)}


def test_trace_round_trip_and_errors(tmp_path):
    specs = [RequestSpec(0.5, 100, 10), RequestSpec(0.0, 7, 3)]
    path = tmp_path / "t.jsonl"
    write_trace(specs, path)
    assert generate(WorkloadConfig(kind="trace", trace=str(path))) == sorted(specs, key=lambda s: s.arrival_s)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 5, "output_len": 1}\n{"arrival_s": 1, "prompt_len": 0, "output_len": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        read_trace(bad)
    bad.write_text('{"arrival_s": 0}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: no prompt_len, output_len"):
        read_trace(bad)


def test_a_trace_at_a_set_rate_keeps_its_lengths_at_poisson_arrivals(tmp_path):
    """What a capacity search over a trace probes (bench serve --trace --capacity, plan)."""
    specs = [RequestSpec(i * 10.0, 100 + i, 1 + i % 7) for i in range(4000)]
    path = tmp_path / "t.jsonl"
    write_trace(specs, path)
    got = generate(WorkloadConfig(kind="trace", trace=str(path), qps=8.0))
    assert [(s.prompt_len, s.output_len) for s in got] == [(s.prompt_len, s.output_len) for s in specs]
    arrivals = [s.arrival_s for s in got]
    assert arrivals == sorted(arrivals) and len(got) / arrivals[-1] == pytest.approx(8.0, rel=0.05)
    assert generate(WorkloadConfig(kind="trace", trace=str(path), qps=8.0)) == got  # seeded


@pytest.mark.parametrize("kw, field", [(dict(kind="poisson"), "kind"), (dict(min_len=5000), "min_len"),
                                       (dict(qps=0.0), "qps"), (dict(kind="trace"), "trace"),
                                       (dict(pd_ratio=0), "pd_ratio")])
def test_bad_workload_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"workload.{field}"):
        WorkloadConfig(**kw).validate()
