"""`pp-runtime run`'s arrivals (cli/run.py): the main job's requests arrive at Poisson times,
so its report has a steady state; with --config they arrive at once unless --qps."""
from argparse import Namespace

import pytest

from pp_runtime.cli.run import (MAIN_JOB_QPS, MAIN_JOB_REQUESTS, run_arrivals,
                                run_prompt_args)


def args(**kw):
    base = dict(config=None, checkpoint=None, requests=None, max_tokens=24, temperature=0.0,
                top_p=1.0, min_prompt=None, max_prompt=None, qps=None)
    return Namespace(**{**base, **kw})


def test_the_main_job_arrives_at_poisson_times():
    n, _, _ = run_prompt_args(args(), 1024)
    assert n == MAIN_JOB_REQUESTS
    times, qps = run_arrivals(args(), n, 0)
    assert qps == MAIN_JOB_QPS and len(times) == n
    assert all(b >= a for a, b in zip(times, times[1:])) and times[0] > 0
    assert run_arrivals(args(), n, 0) == (times, qps)  # seeded: the same every run
    assert run_arrivals(args(), n, 1)[0] != times


def test_a_config_runs_its_requests_at_once_unless_qps_is_given():
    assert run_prompt_args(args(config="tiny"), 1024)[0] == 8
    assert run_arrivals(args(config="tiny"), 8, 0) == (None, None)
    times, qps = run_arrivals(args(config="tiny", qps=4.0), 400, 0)
    assert qps == 4.0 and times[-1] / 400 == pytest.approx(1 / 4.0, rel=0.15)
    assert run_arrivals(args(qps=0.0), 8, 0) == (None, None)  # the main job at once


def test_a_negative_rate_is_a_clear_error(capsys):
    from pp_runtime.cli.main import main

    assert main(["run", "--qps", "-1"]) == 2  # argparse's check, before anything starts
    assert capsys.readouterr().err.strip() == "error: --qps: must be >= 0, got -1"
