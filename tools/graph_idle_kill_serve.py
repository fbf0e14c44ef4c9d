"""`pp-runtime serve` on the compiled graph: one completion, the graph idle, SIGKILL a stage
actor, `/health` polled until 503 (the liveness probe's ping), SIGTERM; prints the exit
code and whether Ray logged a `Check failed` (issue 23; docs/distributed.md).

    python tools/graph_idle_kill_serve.py [PP]
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/serve")]

from running_server import Server, cmdline, descendants  # noqa: E402


def main(pp: str) -> None:
    flags = ["--config", "tiny", "--set", "executor=ray", "--set", f"pp={pp}",
             "--set", "threads_per_worker=1", "--set", "compiled_graph=true"]
    srv = Server(*flags).wait_ready()
    print("ready:", [line for line in srv.log().splitlines() if "ready in" in line], flush=True)
    status, _ = srv.json("POST", "/v1/completions",
                         {"model": "tiny-gpt", "prompt": [5] * 10, "max_tokens": 4})
    print("completion", status, flush=True)
    time.sleep(1.0)  # the graph idle
    stage = re.compile(r"ray::(StageActor|stage\d+-tp\d+\.)")
    pids = [p for p in descendants(srv.proc.pid) if stage.match(cmdline(p))]
    os.kill(pids[-1], signal.SIGKILL)
    t0 = time.monotonic()
    while (health := srv.json("GET", "/health", auth=False))[0] != 503:
        assert srv.proc.poll() is None, "server died:\n" + srv.log()[-3000:]
        assert time.monotonic() - t0 < 60, health
        time.sleep(0.2)
    print("health", health, flush=True)
    srv.proc.send_signal(signal.SIGTERM)
    rc = srv.proc.wait(90)
    log = srv.log()
    print(f"RESULT rc={rc} check_failed={log.count('Check failed')}", flush=True)
    if rc not in (0, 143) or "Check failed" in log:
        print(log[-4000:])
    srv.stop()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "2")
