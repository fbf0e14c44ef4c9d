"""A real `pp-runtime serve` process on 127.0.0.1 for the server tests, and raw HTTP to it."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from pp_runtime.core.net import free_port


class Server:
    """`pp-runtime serve ARGS --port P`; `wait_ready()` polls /health until 200."""

    def __init__(self, *args: str, api_key: str | None = None):
        self.port, self.api_key = free_port(), api_key
        self.url = f"http://127.0.0.1:{self.port}"
        # the console script installed beside this interpreter (a virtualenv's, not the
        # first one on PATH: that may be another install's), else the module
        exe = shutil.which("pp-runtime", path=str(Path(sys.executable).parent))
        cmd = [exe] if exe else [sys.executable, "-m", "pp_runtime.cli"]
        cmd += ["serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        self.log_path = Path(tempfile.mkstemp(prefix="pp-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                if self.request("GET", "/health", auth=False)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def request(self, method: str, path: str, body=None, auth: bool = True,
                timeout: float = 60) -> tuple[int, dict, bytes]:
        """(status, headers (lower-case names), body); `body` a dict (sent as JSON) or bytes."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if auth and self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, _lower(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, _lower(err.headers), err.read()

    def json(self, method: str, path: str, body=None, **kw) -> tuple[int, dict]:
        status, _, raw = self.request(method, path, body, **kw)
        return status, json.loads(raw)

    def open_stream(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, object]:
        """A streaming POST whose connection the caller can drop mid-stream."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn.request("POST", path, json.dumps({**body, "stream": True}), headers)
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        return conn, resp

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


def finished_count(server, reason: str) -> float:
    """Requests the server counted as finished with `reason` (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    _, _, raw = server.request("GET", "/metrics")
    for family in text_string_to_metric_families(raw.decode()):
        if family.name == "pp_runtime_requests_finished":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels["finish_reason"] == reason)
    return 0.0


def _lower(headers) -> dict:
    return {k.lower(): v for k, v in headers.items()}


def next_event(resp) -> dict | str:
    """The next server-sent event's data: a dict, or "[DONE]"."""
    while True:
        line = resp.readline()
        assert line, "stream ended without [DONE]"
        if line.startswith(b"data: "):
            data = line[6:].strip().decode()
            return data if data == "[DONE]" else json.loads(data)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
