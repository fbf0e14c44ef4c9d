"""Ray's start-up output goes to a log (`output_to_log`), its errors still to the terminal.

Each case runs in a child process: the redirection is of file descriptors 1 and 2, which
pytest's capture replaces with objects of its own."""
import os
import subprocess
import sys
import textwrap

from pp_runtime.executors.local_ray import start_log

PRELUDE = """
import logging, subprocess, sys
from pathlib import Path
from pp_runtime.executors.local_ray import output_to_log
log = Path(sys.argv[1])
"""


def child(code: str, log) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), str(log)],
                          capture_output=True, text=True, timeout=60)


def test_the_start_log_is_one_per_process():
    assert start_log() == start_log() and str(os.getpid()) in start_log().name


def test_output_of_loggers_and_child_processes_goes_to_the_log(tmp_path):
    log = tmp_path / "ray.log"
    r = child("""
        logger = logging.getLogger("ray")  # as Ray's: a handler on sys.stderr
        logger.addHandler(logging.StreamHandler())
        with output_to_log(log):
            logger.warning("WARNING Token authentication is enabled")
            print("Started a local Ray instance.")
            subprocess.run(["sh", "-c", "echo from a child >&2"], check=True)
        print("ours")
        """, log)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ours\n" and r.stderr == ""
    text = log.read_text()
    assert "Token authentication" in text and "Started a local Ray" in text and "from a child" in text


def test_error_lines_and_a_failures_tail_still_reach_stderr(tmp_path):
    log = tmp_path / "ray.log"
    r = child("""
        with output_to_log(log):
            print("INFO fine")
            print("2026-01-01 ERROR gcs did not start", file=sys.stderr)
        """, log)
    assert r.returncode == 0 and r.stdout == ""
    assert "ERROR gcs did not start" in r.stderr and "INFO fine" not in r.stderr
    assert str(log) in r.stderr
    r = child("""
        with output_to_log(log):
            print("the last words")
            raise RuntimeError("ray.init failed")
        """, log)
    assert r.returncode == 1 and "RuntimeError: ray.init failed" in r.stderr
    assert "the last words" in r.stderr and "ERROR gcs" not in r.stderr  # this start's lines only
