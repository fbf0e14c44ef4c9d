"""What protects `pp-runtime serve` from its clients, on a real server process (GPT-2
small shapes in the server's own process: ~25 ms a token, so a long request outlives its
client; `--max-waiting 0`, a 1 MB body limit, an API key):
a table of hostile requests and the status each gets; a 100 MB body is a 413 and the
server's memory stays flat; a non-streamed request whose client hangs up frees its KV
within a second; a burst the free KV blocks hold is served whole at --max-waiting 0; and
serve's bad flags are one line with exit 2 before anything starts."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from running_server import Server, finished_count

KEY = "limits-key"
MB = 2**20
FLAGS = ["--config", "default", "--set", "executor=local", "--set", "threads_per_worker=1",
         "--max-waiting", "0", "--max-body-mb", "1"]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    srv = Server(*FLAGS, api_key=KEY)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def post(server, body, headers=None, path="/v1/completions", auth=f"Bearer {KEY}"):
    """(status, parsed body) of a raw POST with exactly these headers."""
    import http.client

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    hdrs = {**({"Authorization": auth} if auth else {}), **(JSON if headers is None else headers)}
    conn.request("POST", path, data, hdrs)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


OK = {"model": "gpt2-small", "prompt": [1, 2, 3], "max_tokens": 2}
CHAT = {"model": "gpt2-small", "max_tokens": 2}
HOSTILE = [  # (id, path, body, headers, auth, status, the field the error names)
    ("text-plain", "/v1/completions", OK, {"Content-Type": "text/plain"}, None, 415, "Content-Type"),
    ("form", "/v1/completions", OK, {"Content-Type": "application/x-www-form-urlencoded"}, None, 415, "Content-Type"),
    ("no-content-type", "/v1/completions", OK, {}, None, 415, "Content-Type"),
    ("json-charset", "/v1/completions", OK, {"Content-Type": "application/json; charset=utf-8"}, None, 200, None),
    ("lowercase-bearer", "/v1/completions", OK, None, f"bearer {KEY}", 200, None),
    ("wrong-key", "/v1/completions", OK, None, "Bearer nope", 401, None),
    ("basic-auth", "/v1/completions", OK, None, f"Basic {KEY}", 401, None),
    ("temperature-2.5", "/v1/completions", {**OK, "temperature": 2.5}, None, None, 400, "temperature"),
    ("temperature-1e308", "/v1/completions", {**OK, "temperature": 1e308}, None, None, 400, "temperature"),
    ("temperature-2-int", "/v1/completions", {**OK, "temperature": 2}, None, None, 200, None),
    ("temperature-2.0", "/v1/completions", {**OK, "temperature": 2.0}, None, None, 200, None),
    ("logit-bias", "/v1/completions", {**OK, "logit_bias": {"5": 100}}, None, None, 400, "logit_bias"),
    ("logit-bias-empty", "/v1/completions", {**OK, "logit_bias": {}}, None, None, 200, None),
    ("suffix", "/v1/completions", {**OK, "suffix": "end"}, None, None, 400, "suffix"),
    ("unknown-field", "/v1/completions", {**OK, "mirostat": 2}, None, None, 400, "mirostat"),
    ("user-is-fine", "/v1/completions", {**OK, "user": "u1"}, None, None, 200, None),
    ("tools", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "1 2"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, None, None, 400, "tools"),
    ("response-format", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "1 2"}],
                                                 "response_format": {"type": "json_object"}}, None, None, 400, "response_format"),
    ("response-format-text", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "1 2"}],
                                                      "response_format": {"type": "text"}}, None, None, 200, None),
    ("top-logprobs", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "1 2"}],
                                              "top_logprobs": 3}, None, None, 400, "top_logprobs"),
    ("text-part-null", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": None}]}]}, None, None, 400, "messages[0].content[0].text"),
    ("image-part", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, None, 400,
     "messages[0].content[0].type"),
    ("text-part", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "1 2"}]}]}, None, None, 200, None),
    ("message-name", "/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": "1", "name": "bob"}]}, None, None, 400, "messages[0].name"),
    ("body-2mb", "/v1/completions", {**OK, "user": "x" * (2 * MB)}, None, None, 413, "body"),
]


@pytest.mark.parametrize("path, body, headers, auth, status, param",
                         [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_its_status(server, path, body, headers, auth, status, param):
    got, out = post(server, body, headers, path, auth or f"Bearer {KEY}")
    assert got == status, out
    if status != 200:
        assert set(out["error"]) == {"message", "type", "param", "code"}, out
        assert out["error"]["param"] == param, out
    else:
        assert len(out["choices"][0]["token_ids"]) == 2


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def send_big(server, size: int, chunked: bool) -> bytes:
    """POST `size` bytes (declared in Content-Length, or chunked), sending until the server
    answers or closes; the response's first bytes."""
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    length = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\n{length}\r\n\r\n".encode())
    piece, sent = b"[" * MB, 0
    try:
        while sent < size:
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: the rest was never read
    s.settimeout(30)
    try:
        return s.recv(200)
    except ConnectionResetError:
        return b""
    finally:
        s.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_100_mb_body_is_a_413_and_memory_stays_flat(server, chunked):
    before = rss_mb(server.proc.pid)
    head = send_big(server, 100 * MB, chunked)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert rss_mb(server.proc.pid) - before < 20  # MB; reading it all took 100+
    assert server.json("GET", "/health", auth=False)[0] == 200


def running(server) -> int:
    return server.json("GET", "/health", auth=False)[1]["running"]


def test_a_non_streamed_request_whose_client_leaves_frees_its_kv_within_a_second(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = json.dumps({**OK, "max_tokens": 200, "ignore_eos": True, "prompt": [5] * 40}).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
              + body)
    deadline = time.monotonic() + 30
    while running(server) < 1:
        assert time.monotonic() < deadline, "it never ran"
        time.sleep(0.02)
    aborted = finished_count(server, "aborted")
    s.close()  # the client gives up, seconds before its 200 tokens would be done
    t0 = time.monotonic()
    while running(server) > 0:
        assert time.monotonic() - t0 < 1.0, "its KV blocks are still held a second later"
        time.sleep(0.02)
    assert finished_count(server, "aborted") == aborted + 1  # it did not run to its end


def test_max_waiting_0_serves_a_burst_the_free_blocks_hold(server):
    """8 requests at once on an idle server: the KV blocks hold them all, so none waits
    and none is refused, although no request may wait (--max-waiting 0)."""
    results = []

    def one(i):
        results.append(post(server, {**OK, "prompt": [1 + i] * 20, "max_tokens": 4}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(status for status, _ in results) == [200] * 8, results


BAD_FLAGS = [  # (id, flags, env, what the one line says)
    ("port-70000", ["--port", "70000"], {}, "--port: 70000 is not a TCP port"),
    ("port-negative", ["--port", "-1"], {}, "--port: -1 is not a TCP port"),
    ("open-without-key", ["--host", "0.0.0.0"], {}, "--host 0.0.0.0: listening beyond this machine needs an API key"),
    ("key-file-missing", ["--api-key-file", "/nonexistent/key"], {}, "--api-key-file /nonexistent/key: cannot read it"),
    ("key-file-env-empty", [], {"PP_RUNTIME_API_KEY_FILE": os.devnull}, "the API key must be one word"),
    ("max-body-0", ["--max-body-mb", "0"], {}, "--max-body-mb: must be > 0, got 0"),
    ("max-waiting-negative", ["--max-waiting", "-1"], {}, "--max-waiting: must be >= 0, got -1"),
    ("max-body-huge", ["--max-body-mb", "2048"], {}, "--max-body-mb: must be <= 1024, got 2048"),
    ("port-not-a-number", ["--port", "http"], {}, "--port: expected a whole number, got 'http'"),
]


@pytest.mark.parametrize("flags, env, message", [b[1:] for b in BAD_FLAGS], ids=[b[0] for b in BAD_FLAGS])
def test_bad_serve_flags_are_one_line_and_exit_2(flags, env, message):
    proc = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "serve", "--config", "tiny", *flags],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PP_RUNTIME_API_KEY": ""})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr
    assert not proc.stdout  # nothing started


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    from pp_runtime.cli.serve import is_loopback, read_api_key

    key = tmp_path / "key"
    key.write_text("s3cret\n")
    monkeypatch.delenv("PP_RUNTIME_API_KEY", raising=False)
    monkeypatch.delenv("PP_RUNTIME_API_KEY_FILE", raising=False)
    assert read_api_key(None, None) is None
    assert read_api_key(None, str(key)) == "s3cret"
    monkeypatch.setenv("PP_RUNTIME_API_KEY_FILE", str(key))
    assert read_api_key(None, None) == "s3cret"
    assert read_api_key("flag", None) == "flag"  # the flag wins
    monkeypatch.delenv("PP_RUNTIME_API_KEY_FILE")
    monkeypatch.setenv("PP_RUNTIME_API_KEY", "from-env")
    assert read_api_key(None, None) == "from-env"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
