"""The command line: the README's main job on a small config, and clean errors."""
import subprocess
import sys


def cli(*args):
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_run_prints_one_line_per_microbatch_and_every_request():
    r = cli("run", "--config", "tiny", "--requests", "3", "--max-prompt", "70",
            "--max-tokens", "4", "--set", "pp=2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    mb_lines = [line for line in lines if line.startswith("mb ")]
    assert mb_lines and "prefill r0 [0:" in mb_lines[0]
    assert any("decodes (kv" in line and "prefill" in line for line in mb_lines)  # piggybacked
    assert sum(" length " in line for line in lines) == 3
    assert "pp=2" in lines[0] and "tok/s" in lines[-1]


def test_bad_override_is_a_clear_error():
    r = cli("run", "--config", "tiny", "--set", "chunk_size=0")
    assert r.returncode == 2
    assert "planner.chunk_size: must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_memory_reports_the_papers_batch_size():
    r = cli("memory", "--config", "paper/gpt3_tp8_pp8")
    assert r.returncode == 0, r.stderr
    assert "27 per micro-batch" in r.stdout
