"""`pp-runtime serve` on two Ray stage actors stops cleanly whatever receives the signal:
real SIGTERM / SIGINT to the server's PID or to its whole process group, mid-stream,
idle (after a stage actor died, which /health reports within seconds) and during
start-up. Each run checks the exit code (143 / 130) within seconds, an error event then
[DONE] on every open stream, no traceback or Ray stack dump, and that no process the
server started (watched every 0.1 s) and no port they listened on is left."""
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from running_server import cmdline, free_port
from processes import Run, check_clean_exit

pytestmark = pytest.mark.slow  # each test starts a server and a local Ray

FLAGS = ["--config", "tiny", "--set", "executor=ray", "--set", "pp=2",
         "--set", "threads_per_worker=1", "--set", "max_batch_size=4"]


class Serve(Run):
    def __init__(self):
        self.port = free_port()
        super().__init__("serve", *FLAGS, "--port", str(self.port))

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
        except OSError:
            return 0, {}

    def ready(self) -> bool:
        return self.health()[0] == 200


@pytest.fixture
def start():
    """Serve(); a server a failed test left running is stopped (SIGTERM, then SIGKILL)."""
    started = []
    yield lambda: started.append(Serve()) or started[-1]
    for srv in started:
        if srv.proc.poll() is None:
            os.killpg(srv.proc.pid, signal.SIGTERM)
            try:
                srv.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(srv.proc.pid, signal.SIGKILL)


def stream(port: int, events: list, started: threading.Event) -> None:
    """A streamed request of 230 tokens (seconds of work); every event's data, in order."""
    body = json.dumps({"model": "tiny-gpt", "prompt": [7] * 20, "max_tokens": 230,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                if line.startswith(b"data: "):
                    data = line[6:].strip().decode()
                    events.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except OSError as exc:  # the connection dropped without an end: what must not happen
        events.append(exc)
    started.set()


@pytest.mark.parametrize("sig, group, code", [(signal.SIGTERM, False, 143),
                                              (signal.SIGINT, True, 130)],
                         ids=["sigterm-pid", "sigint-group"])
def test_a_signal_mid_stream_ends_open_streams_with_an_error_event(start, sig, group, code):
    srv = start()
    srv.wait_for(srv.ready)
    streams = [([], threading.Event()) for _ in range(2)]
    threads = [threading.Thread(target=stream, args=(srv.port, ev, st), daemon=True)
               for ev, st in streams]
    for t in threads:
        t.start()
    for events, started in streams:
        assert started.wait(60) and not isinstance(events[0], Exception), events
    took = srv.signal(sig, group)
    for t in threads:
        t.join(30)
    check_clean_exit(srv, code, took)
    for events, _ in streams:
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "aborted" and "shutting down" in error["message"]
        tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
        assert 0 < len(tokens) < 230
    assert f"stopped (interrupted by {signal.Signals(sig).name})" in srv.err


def stage_actors(srv: Run) -> list[int]:
    return [p for p in srv.procs if cmdline(p).startswith(("ray::StageActor", "ray::stage"))]


def test_an_idle_actor_that_dies_is_found_by_the_probe_and_replaced_and_a_group_sigterm_still_stops_it(start):
    srv = start()
    srv.wait_for(srv.ready)
    actors = stage_actors(srv)
    assert len(actors) == 2, [cmdline(p)[:60] for p in srv.procs]
    os.kill(actors[-1], signal.SIGKILL)  # nothing is running: only the probe can notice
    t0, seen = time.monotonic(), []
    while (health := srv.health())[1].get("recoveries", 0) < 1:  # found, then replaced
        seen.append(health[1]["status"])
        # found and replaced, not hung: alone 36-42 s for the whole test (one core busy
        # beside it or not), but with the suite's other worker starting servers beside it
        # the replacement's start took past 30 s (75 s for the test, 2026-11-27)
        assert time.monotonic() - t0 < 90, f"/health still {health} 90 s after the death"
        time.sleep(0.1)
    assert health[0] == 200 and health[1]["status"] == "ok", health
    assert "recovering" in seen, seen  # 503 meanwhile
    srv.wait_for(lambda: len(stage_actors(srv)) == 2 and actors[-1] not in stage_actors(srv), 10)
    took = srv.signal(signal.SIGTERM, group=True)  # as Slurm, systemd and docker stop send it
    check_clean_exit(srv, 143, took)


def test_a_group_sigterm_while_ray_starts_stops_everything(start):
    srv = start()
    srv.wait_for(lambda: any("raylet" in cmdline(p) for p in srv.procs))
    took = srv.signal(signal.SIGTERM, group=True)
    check_clean_exit(srv, 143, took)  # within STOP_S (6-7 s alone, 24 s once in CI's suite)
    out = "".join(srv.stdout)
    assert "ready in" not in out, f"{took:.1f} s: the start was not given up:\n{out[-2000:]}"
    assert "Traceback" not in out
