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


def test_qwen3_32b_is_priced_with_its_128_wide_heads(tmp_path):
    """M_S = 32.76B parameters x 2 bytes / (tp x pp); m_kv = K and V of 64 / pp layers,
    8 / tp KV heads of 128, bf16 (not hidden / heads = 80 wide)."""
    cfg = tmp_path / "qwen3.yaml"
    cfg.write_text("model: qwen3-32b\nparallel: {tp: 4, pp: 2}\n"
                   "cache: {device_memory_gb: 80, max_seq_len: 8192}\n")
    out = memory("--config", str(cfg))
    assert f"M_S={32_762_123_264 * 2 / 8 / 2**30:.2f} GiB" in out
    assert f"m_kv={2 * 32 * 2 * 128 * 2} B/token" in out
