"""`pp-runtime memory` says why B is 0 instead of printing B=0 alone."""
import subprocess
import sys


def memory(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "memory", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_b_0_says_the_weights_do_not_fit():
    out = memory("--config", "paper/gpt3_tp8", "--device-memory-gb", "40")
    assert "B=0 requests per device" in out
    assert "B=0: the weights (40.66 GiB) do not fit in the usable 33.53 GiB" in out
    assert "max_seq_len" not in out.split("B=0: ")[1].splitlines()[0]


def test_b_0_says_one_requests_kv_does_not_fit_beside_the_weights():
    out = memory("--config", "paper/gpt3_tp8", "--device-memory-gb", "49")
    assert "B=0: after the weights" in out and "less than one request's KV" in out
    assert "a shorter max_seq_len" in out


def test_a_nonzero_b_has_no_explanation():
    assert "B=0" not in memory("--config", "paper/gpt3_tp8", "--device-memory-gb", "80")
