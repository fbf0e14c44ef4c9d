"""pp-runtime serve, compiled graph, PP=2: a request, idle, SIGKILL a stage actor, /health
503 (the probe's ping), SIGTERM; prints the exit code and whether a Check failed."""
import os, re, signal, sys, time
from pathlib import Path
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/serve")]
from running_server import Server, descendants, cmdline
pp = sys.argv[1] if len(sys.argv) > 1 else "2"
flags = ["--config", "tiny", "--set", "executor=ray", "--set", f"pp={pp}", "--set", "threads_per_worker=1",
         "--set", "compiled_graph=true"]
srv = Server(*flags).wait_ready()
print("ready:", [l for l in srv.log().splitlines() if "ready in" in l], flush=True)
st, body = srv.json("POST", "/v1/completions", {"model": "tiny-gpt", "prompt": [5] * 10, "max_tokens": 4})
print("completion", st, flush=True)
time.sleep(1.0)
pids = [p for p in descendants(srv.proc.pid) if re.match(r"ray::(StageActor|stage\d+-tp\d+\.)", cmdline(p))]
os.kill(pids[-1], signal.SIGKILL)
t0 = time.monotonic()
while (h := srv.json("GET", "/health", auth=False))[0] != 503:
    assert srv.proc.poll() is None, "server died:\n" + srv.log()[-3000:]
    assert time.monotonic() - t0 < 60, h
    time.sleep(0.2)
print("health", h, flush=True)
srv.proc.send_signal(signal.SIGTERM)
rc = srv.proc.wait(90)
log = srv.log()
print(f"RESULT rc={rc} check_failed={log.count('Check failed')} sigsegv={log.count('SIGSEGV')}", flush=True)
if rc != 0 or "Check failed" in log:
    print(log[-4000:])
srv.stop()
