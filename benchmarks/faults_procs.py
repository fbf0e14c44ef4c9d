"""benchmarks/faults.py's eyes on the server: its processes (titles, the tree under it,
memory, the CPU other processes take), /health polled every 0.2 s, and the thread that
SIGKILLs (or SIGSTOPs) a stage actor every --kill-every s and times the way back."""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import psutil

STAGE_TITLE = re.compile(r"ray::stage(\d+)-tp0\.")  # a stage actor (TP rank 0) running a call
ACTOR_TITLE = re.compile(r"ray::(StageActor|stage\d+-tp\d+\.)")  # any stage actor, idle or busy


# ---- the server's processes, its health, the faults -------------------------------------

def title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tree(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def memory(pid: int) -> tuple[float, int]:
    """(RSS in MiB summed over the server and every process under it, stage actor processes)."""
    rss, actors = 0, 0
    for q in tree(pid):
        try:
            rss += psutil.Process(q).memory_info().rss
            actors += bool(ACTOR_TITLE.match(title(q)))
        except psutil.Error:
            pass
    return rss / 2**20, actors


def cpu_of_others(pid: int) -> dict[int, float]:
    """CPU seconds of every process outside the server's tree and this one (other users'
    work on the shared cores), by pid."""
    ours, out = {os.getpid(), *tree(pid)}, {}
    for proc in psutil.process_iter():
        try:
            if proc.pid not in ours:
                c = proc.cpu_times()
                out[proc.pid] = c.user + c.system
        except psutil.Error:
            pass
    return out


def phase_share(pid: int):
    """From now: a call returns the share of all cores that other processes used meanwhile
    (those alive at the call; one that ended in between is not counted)."""
    t0, c0 = time.monotonic(), cpu_of_others(pid)

    def share() -> float:
        used = sum(c - c0.get(q, 0.0) for q, c in cpu_of_others(pid).items())
        return used / ((time.monotonic() - t0) * (os.cpu_count() or 1))
    return share


class Health(threading.Thread):
    """GET /health every 0.2 s: (time, HTTP status (0: no answer), its "status")."""

    def __init__(self, url: str):
        super().__init__(daemon=True, name="health")
        self.url, self.samples, self.stop = url + "/health", [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            t, code, body = time.monotonic(), 0, b"{}"
            try:
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    code, body = resp.status, resp.read()
            except urllib.error.HTTPError as err:
                code, body = err.code, err.read()
            except OSError:
                pass
            try:
                status = json.loads(body).get("status", "?") if code else "no answer"
            except ValueError:
                status = "?"
            self.samples.append((t, code, status))

    def back(self, t: float) -> tuple[float | None, list[str]]:
        """(the first 200 after a non-200 after t, the statuses seen in between)."""
        seen, down = [], False
        for ts, code, status in [s for s in list(self.samples) if s[0] > t]:
            if code != 200:
                down = True
                seen += [status] if status not in seen else []
            elif down:
                return ts, seen
        return None, seen


@dataclass
class Fault:
    n: int
    at_s: float  # from the faults phase's start
    stage: int
    pid: int | None
    t: float = 0.0
    health_back: float | None = None
    statuses: list = field(default_factory=list)
    rss_mib: float | None = None
    actors: int | None = None
    hung_pid_alive: bool | None = None  # --hang: the stopped process still there after
    load: float | None = None  # the machine's 1-min load average once back
    others: float | None = None  # share of all cores other processes took until back
    timeline: list = field(default_factory=list)  # (s after the fault, pid, new title)


class Killer(threading.Thread):
    """A fault every `every` s (stages in turn) up to `seconds`; after each, waits for
    /health to turn 200 again, then samples memory and the stage actor processes."""

    def __init__(self, server_pid: int, args, health: Health):
        super().__init__(daemon=True, name="killer")
        self.server_pid, self.args, self.health = server_pid, args, health
        self.faults: list[Fault] = []
        self.stages: dict[int, int] = {}  # pid -> stage, as its title showed it
        self.stop = threading.Event()

    def find(self, stage: int, timeout: float = 5.0) -> int | None:
        """The stage's actor, once its title shows it running a call (an idle one's title
        is `ray::StageActor`: then the pid last seen with the stage's title)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for q in tree(self.server_pid)[1:]:
                if (m := STAGE_TITLE.match(title(q))) and q not in {f.pid for f in self.faults}:
                    self.stages[q] = int(m.group(1))  # (a stopped actor keeps its title: not again)
                    if self.stages[q] == stage:
                        return q
            time.sleep(0.02)
        return next((q for q, s in self.stages.items() if s == stage and alive(q)
                     and q not in {f.pid for f in self.faults}), None)

    def watch(self, f: Fault, titles: dict[int, str]) -> None:
        """Note each Ray process's title change while the server recovers: which call the
        new actors run when (`ray::stage0-tp0.start`, ...), to see where the time goes."""
        for q in tree(self.server_pid)[1:]:
            if re.match(r"ray::(StageActor|stage|IDLE)", name := title(q)) and titles.get(q) != name:
                titles[q] = name
                f.timeline.append((round(time.monotonic() - f.t, 2), q, name.split()[0][:40]))

    def run(self) -> None:
        a, t0 = self.args, time.monotonic()
        for n in itertools.count(1):
            if n * a.kill_every > a.minutes * 60 or \
                    self.stop.wait(max(0.0, t0 + n * a.kill_every - time.monotonic())):
                return
            pid = self.find((n - 1) % a.pp)
            self.faults.append(f := Fault(n, time.monotonic() - t0, (n - 1) % a.pp, pid))
            if pid is None:
                continue
            share = phase_share(self.server_pid)
            os.kill(pid, signal.SIGSTOP if a.hang else signal.SIGKILL)
            f.t = time.monotonic()
            f.at_s = f.t - t0
            titles: dict[int, str] = {}
            while (back := self.health.back(f.t))[0] is None and time.monotonic() < f.t + a.recovery_wait_s:
                self.watch(f, titles)
                if self.stop.wait(0.05):
                    return
            f.health_back, f.statuses, f.others = *back, share()
            if f.health_back is None:
                return  # no more faults for a server that did not come back
            self.stop.wait(2.0)  # the new actors settle
            f.rss_mib, f.actors = memory(self.server_pid)
            f.load = os.getloadavg()[0]
            f.hung_pid_alive = alive(pid) if a.hang else None
