"""`pp-runtime report DIR` re-plots a directory that may come from someone else: a plot file
that is a symlink is replaced, never written through to its target, and report.json's
strings reach the terminal without their control characters (ANSI escapes shown as \\x1b)."""
import json
import os
import subprocess
import sys


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_report_replaces_a_symlinked_plot_and_prints_no_terminal_escapes(tmp_path):
    run = tmp_path / "run"
    assert cli("simulate", "--config", "tiny", "--requests", "5", "--quiet", "--out", str(run)).returncode == 0
    pngs = sorted(run.glob("*.png"))
    assert pngs
    victim = tmp_path / "victim.txt"  # what a planted link points at
    victim.write_text("precious")
    pngs[0].unlink()
    pngs[0].symlink_to(victim)
    report = json.loads((run / "report.json").read_text())
    report["summary"]["planner"] = "sarathi\x1b[2J\x1b]0;pwned\x07"
    (run / "report.json").write_text(json.dumps(report))
    out = cli("report", str(run))
    assert out.returncode == 0, out.stderr
    assert victim.read_text() == "precious"
    assert not pngs[0].is_symlink() and pngs[0].stat().st_size > 1000  # a fresh plot
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "sarathi\\x1b[2J\\x1b]0;pwned\\x07" in out.stdout
    assert not list(run.glob(".*.tmp"))
