"""A request held back for longer than a real run can wait (arrival_s over a day) is
refused before anything runs: from Python (`LLM.generate`) and from `run --workload` with a
trace, where the run would otherwise sit idle for 31 years without a word."""
import json
import os
import subprocess
import sys
import time

import pytest

from pp_runtime import LLM, SamplingParams
from pp_runtime.core.request import InvalidRequestError


def test_generate_refuses_an_arrival_over_a_day_away_and_runs_nothing():
    llm = LLM("tiny", executor="local", pp=1)
    try:
        with pytest.raises(InvalidRequestError, match=r"request 1: arrival_s 1e\+09 is over a day"):
            llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), arrival_s=[0.0, 1e9])
        assert llm.engine.num_running() == llm.engine.num_waiting() == 0
        out = llm.generate([[1, 2]], SamplingParams(max_tokens=2), arrival_s=[0.5])  # still usable
        assert len(out[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_run_workload_with_a_far_arrival_is_one_line_and_exit_2(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_s": 0, "prompt_len": 8, "output_len": 2},
        {"arrival_s": 1e9, "prompt_len": 8, "output_len": 2}]))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "run", "--workload", "--config", "tiny",
                           "--set", "workload.kind=trace", "--set", f"workload.trace={trace}",
                           "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "request 1: arrival_s 1e+09 is over a day" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out" / "report.json").exists()
