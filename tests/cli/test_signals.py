"""Ctrl-C and SIGTERM end a run cleanly: real signals to real `pp-runtime` processes.

Each test starts the command in its own session, waits until it is where the signal should
land (generating, or starting Ray), signals it, and checks what a user is promised
(docs/errors.md): exit 130 / 143 within seconds, no traceback, a strict-JSON partial report
in which every request has a finish reason, and nothing left behind: no process the run
started (watched while it ran) and no port they listened on.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from processes import Run, check_clean_exit, process_name

def _no_nan(token: str):
    raise ValueError(f"report.json is not strict JSON: {token}")


def check_partial_report(out: Path, signame: str) -> dict:
    """report.json is strict JSON, says it is partial and why, and every request ended."""
    report = json.loads((out / "report.json").read_text(), parse_constant=_no_nan)
    s = report["summary"]
    assert s["partial"] is True and s["interrupted_by"] == signame
    reasons = [r["finish_reason"] for r in report["requests"]]
    assert reasons and set(reasons) <= {"length", "eos", "error"} and "error" in reasons
    assert s["finish_reasons"].get("error") == reasons.count("error")
    outputs = (out / "outputs.jsonl").read_text().splitlines()
    assert len(outputs) == len(reasons)
    return report


RAY_TINY = ("--config", "tiny", "--set", "pp=2", "--set", "executor=ray", "--set",
            "threads_per_worker=1", "--requests", "32", "--max-tokens", "120")


@pytest.mark.parametrize("sig, group, code", [(signal.SIGINT, True, 130),
                                              (signal.SIGTERM, False, 143),
                                              (signal.SIGTERM, True, 143)],
                         ids=["ctrl-c", "sigterm", "sigterm-group"])  # group: as Slurm sends it
@pytest.mark.slow
def test_a_signal_mid_run_ends_a_ray_pipeline_cleanly(tmp_path, sig, group, code):
    # the tiny model as two Ray actors: a real Ray pipeline, without GPT-2 small's weights to
    # build in each actor first (about 20 s of the test on 2 busy cores); 32 requests of 120
    # tokens are about 1000 micro-batches, seconds of them left when the signal lands
    run = Run("run", *RAY_TINY, "--out", str(tmp_path))
    run.wait_for(run.generating)
    assert any(process_name(p).endswith("raylet") or "raylet" in process_name(p) for p in run.procs.values())
    took = run.signal(sig, group)
    check_clean_exit(run, code, took)
    name = signal.Signals(sig).name
    check_partial_report(tmp_path, name)
    out = "".join(run.stdout)
    assert f"PARTIAL: interrupted by {name}" in out and "partial reports and plots in" in out
    assert " error " in out  # the per-request table: unfinished requests ended in error
    assert f"pp-runtime: interrupted by {name}: stopped" in run.err
    assert f"partial report in {tmp_path}/" in run.err
    assert len(run.ports) >= 5  # the check saw Ray's ports (GCS, raylet, agents, workers)


@pytest.mark.slow
def test_ctrl_c_while_ray_starts_leaves_no_agent_behind(tmp_path):
    # the raylet starts its dashboard and runtime-env agents; an interrupted ray.init used
    # to leave them listening for a minute
    run = Run("run", "--config", "cpu/gpt2_pp2", "--out", str(tmp_path))
    run.wait_for(lambda: any("raylet" in process_name(p) for p in run.procs.values()))
    took = run.signal(signal.SIGINT, group=True)
    check_clean_exit(run, 130, took)
    assert "nothing was running yet; no report" in run.err
    assert not (tmp_path / "report.json").exists()


def test_sigterm_ends_an_in_process_run_with_a_partial_report(tmp_path):
    # the local executor; 32 requests of 120 tokens: a few seconds of micro-batches
    run = Run("run", "--config", "tiny", "--requests", "32", "--max-tokens", "120",
              "--out", str(tmp_path))
    run.wait_for(run.generating)
    took = run.signal(signal.SIGTERM)
    check_clean_exit(run, 143, took)
    assert check_partial_report(tmp_path, "SIGTERM")["summary"]["executor"] == "local"


def test_ctrl_c_while_the_report_is_written_waits_for_it(tmp_path):
    # a finished run: the signal lands once report.json is there, while the plots are drawn
    run = Run("run", "--config", "tiny", "--requests", "4", "--max-tokens", "4", "--out", str(tmp_path))
    run.wait_for(lambda: (tmp_path / "report.json").exists(), timeout=120)
    took = run.signal(signal.SIGINT)
    check_clean_exit(run, 130, took)
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["summary"].get("partial") and len(report["requests"]) == 4
    assert {r["finish_reason"] for r in report["requests"]} == {"length"}
    assert len(list(tmp_path.glob("*.png"))) >= 3  # the plots were drawn to the end
    assert f"stopped, after the report was written in {tmp_path}/" in run.err


def test_ctrl_c_ends_a_simulation_with_a_partial_report(tmp_path):
    # a long simulation (about 20 s of work); the signal lands once its progress bar shows
    run = Run("simulate", "--config", "paper/gpt3_tp8_pp8", "--requests", "40000",
              "--out", str(tmp_path))
    run.wait_for(lambda: "simulate sarathi" in run.err)
    took = run.signal(signal.SIGINT)
    check_clean_exit(run, 130, took)
    report = check_partial_report(tmp_path, "SIGINT")
    assert report["summary"]["finish_reasons"].get("length")  # some had finished
    assert "PARTIAL: interrupted by SIGINT" in "".join(run.stdout)


# ---- the mechanism, in this process ---------------------------------------------------

def test_sigterm_raises_like_ctrl_c_and_names_its_exit_code():
    from pp_runtime.core import interrupt

    before = signal.getsignal(signal.SIGTERM)  # Ray's own, if an earlier test started Ray
    with interrupt.handled():
        for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            with pytest.raises(KeyboardInterrupt) as info:
                os.kill(os.getpid(), sig)
                time.sleep(1)
            exc = info.value
            assert str(exc) == f"interrupted by {signal.Signals(sig).name}"
            assert interrupt.exit_code(exc) == code
            del exc, info  # an interrupt still held counts as being handled
    assert signal.getsignal(signal.SIGTERM) == before  # put back


def test_a_signal_while_one_is_handled_is_ignored(capfd):
    from pp_runtime.core import interrupt

    with interrupt.handled():
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGTERM)  # the teardown goes on
            time.sleep(0.1)
        assert "SIGTERM while stopping: ignored" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt):  # handled: the next one raises again
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)


def test_deferred_holds_signals_and_undoes_a_replaced_sigterm_handler():
    # as ray.init does: it installs its own SIGTERM handler, which calls sys.exit(15)
    from pp_runtime.core import interrupt

    with interrupt.handled():
        mine = signal.getsignal(signal.SIGTERM)
        steps = []
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with interrupt.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                steps.append("not cut short")
        assert steps == ["not cut short"]
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            with interrupt.deferred():
                signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) is mine
