"""A real `pp-runtime` process watched while it runs, for the signal tests (tests/cli/
test_signals.py, tests/serve/test_serve_signals.py): its output, every process it started
and the ports they listened on, and the checks of a clean exit."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")  # its copy of psutil (ray/thirdparty_files) when psutil is absent
import psutil  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STOP_S = 30  # from the signal to the exit, on 2 busy cores (about 3-10 s measured)


class Run:
    """`python -m pp_runtime.cli ARGS` in its own session; its output and every process it
    started (polled every 0.1 s) with the ports they listen on are collected as it runs."""

    def __init__(self, *args: str):
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "pp_runtime.cli", *args], cwd=REPO,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.me = psutil.Process(self.proc.pid)
        self.stdout, self.stderr = [], []
        self.procs: dict[int, psutil.Process] = {}
        self.ports: set[tuple[int, int]] = set()  # (pid, port) listening
        self._done = False
        self._threads = [threading.Thread(target=self._read, args=(s, out), daemon=True)
                         for s, out in ((self.proc.stdout, self.stdout),
                                        (self.proc.stderr, self.stderr))]
        self._threads.append(threading.Thread(target=self._watch, daemon=True))
        for t in self._threads:
            t.start()

    def _read(self, stream, out: list) -> None:
        for line in stream:
            out.append(line)

    def _watch(self) -> None:
        while not self._done:
            try:
                kids = self.me.children(recursive=True)
            except psutil.Error:
                kids = []
            for p in kids:
                self.procs.setdefault(p.pid, p)
            pids = {self.proc.pid, *self.procs}
            try:
                self.ports |= {(c.pid, c.laddr.port) for c in psutil.net_connections("inet")
                               if c.status == psutil.CONN_LISTEN and c.pid in pids}
            except psutil.Error:
                pass
            time.sleep(0.1)

    def wait_for(self, what, timeout: float = 240) -> None:
        """Until what() is true (the process must still be running)."""
        deadline = time.monotonic() + timeout
        while not what():
            assert self.proc.poll() is None, f"exited {self.proc.returncode} early:\n" + \
                "".join(self.stdout[-5:]) + "".join(self.stderr[-20:])
            assert time.monotonic() < deadline, "never got there:\n" + "".join(self.stdout[-5:])
            time.sleep(0.05)

    def generating(self) -> bool:
        return sum(line.startswith("mb ") for line in self.stdout) >= 2

    def signal(self, sig: int, group: bool = False) -> float:
        """Send sig (to the whole process group, as a terminal's Ctrl-C does, when group);
        wait for the exit; returns the seconds it took."""
        t0 = time.monotonic()
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            pytest.fail(f"still running {STOP_S} s after {signal.Signals(sig).name}")
        for t in self._threads[:2]:
            t.join(timeout=10)
        self._done = True
        return time.monotonic() - t0

    @property
    def err(self) -> str:
        return "".join(self.stderr)

    def leftovers(self, grace_s: float = 10) -> tuple[list, list]:
        """(processes of the run still alive, ports of the run still listening), after up
        to grace_s for the last ones to exit. Zombies are dead (their parent reaps them)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [p for p in self.procs.values() if _alive(p)]
            ports = {port for _, port in self.ports}
            listening = [c for c in psutil.net_connections("inet")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
                         and (c.pid in self.procs or c.pid == self.proc.pid)]
            if not (alive or listening) or time.monotonic() > deadline:
                return [f"{p.pid} {process_name(p)}" for p in alive], listening
            time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def process_name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()[:2])[-80:] or p.name()
    except psutil.Error:
        return "?"


def check_clean_exit(run: Run, code: int, took: float) -> None:
    assert run.proc.returncode == code, run.err[-3000:]
    assert "Traceback" not in run.err and "*** SIGTERM received" not in run.err, run.err[-3000:]
    assert took < STOP_S
    alive, listening = run.leftovers()
    assert not alive, f"processes of the run still alive: {alive}"
    assert not listening, f"ports of the run still listening: {listening}"
