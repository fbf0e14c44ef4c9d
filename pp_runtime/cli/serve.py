"""`pp-runtime serve`'s flags and their checks; imports neither FastAPI nor torch (the
CLI builds its parser from here on every command).

Every flag is checked before anything starts (one line, exit 2, as `docs/errors.md`
promises): a port outside 0-65535, a negative `--max-waiting`, a body limit <= 0 (these three
as argparse parses them, `cli/common.py`'s one-line errors), an API
key file that cannot be read, and an address beyond loopback without an API key.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

from pp_runtime.core import interrupt
from pp_runtime.config import ConfigError

API_KEY_ENV = "PP_RUNTIME_API_KEY"
API_KEY_FILE_ENV = "PP_RUNTIME_API_KEY_FILE"
MAX_BODY_MB = 4.0  # the same default as serve/app.py's: a 1024-token prompt is ~6 KB of JSON


def add_parser(sub) -> None:
    from pp_runtime.cli.common import (RUN_DEFAULT_CONFIG, add_config_args, add_slo_args, non_negative_int,
                                       number)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the pipeline",
                         description="Serve the model over HTTP with OpenAI's API: "
                                     "/v1/completions and /v1/chat/completions (stream: true for "
                                     "server-sent events), /v1/models, /health (200 once every "
                                     "stage worker is up), /metrics (Prometheus: TTFT, time "
                                     "between tokens, queue, per-stage busy and bubble by cause). "
                                     "Listens on 127.0.0.1 unless --host says otherwise. "
                                     "docs/serving.md")
    add_config_args(srv, f"{RUN_DEFAULT_CONFIG} (2 Ray stage actors); 'default' = all in this process")
    add_slo_args(srv)
    srv.add_argument("--checkpoint", help="Hugging Face-format model directory; its tokenizer "
                                          "is used when present (pp=1 unless --set pp=N)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1: this machine only); any "
                          "other address opens it to the network and needs an API key")
    srv.add_argument("--port", type=tcp_port, default=8000, help="HTTP port (default 8000)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health "
                          f"(visible in ps: prefer --api-key-file or ${API_KEY_ENV})")
    srv.add_argument("--api-key-file", default=None, metavar="FILE",
                     help=f"read the API key from FILE's first line (also ${API_KEY_FILE_ENV})")
    srv.add_argument("--max-waiting", type=non_negative_int, default=1024,
                     help="requests allowed to wait for KV blocks; beyond it 429 with "
                          "Retry-After; 0: no queue (default 1024)")
    srv.add_argument("--max-body-mb", type=number(float, 0, strict=True, high=1024),
                     default=MAX_BODY_MB,
                     help=f"largest request body in MB; above it 413 (default {MAX_BODY_MB:g})")
    srv.add_argument("--no-prefix-cache", action="store_true",
                     help="do not reuse the KV blocks of prompt prefixes already computed "
                          "(prefix caching is on by default when serving)")
    srv.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from pp_runtime.cli.common import config_from_args, run_base_config
    from pp_runtime.costmodel.balance import resolve_layer_split
    from pp_runtime.cli.run import what_runs

    options = check_flags(args)  # before the config: the cheap checks first
    if args.checkpoint:  # a field that changes the math and is not implemented: refused
        from pp_runtime.model.checkpoint_fields import check_math_fields
        from pp_runtime.model.hf_config import read_hf_config
        check_math_fields(read_hf_config(args.checkpoint), f"{args.checkpoint}/config.json")
    base = run_base_config(args)
    serving = {"prefix_caching": True} if not args.no_prefix_cache and base.cache.paged else {}
    cfg = config_from_args(args, base, defaults=serving)  # serving's default; --set wins
    cfg = resolve_layer_split(cfg)  # auto chosen once, where the server builds its executor
    print(what_runs(cfg, args), flush=True)
    if not is_loopback(args.host):
        print(f"pp-runtime serve: warning: --host {args.host} takes requests from the network; "
              "every route but /health needs the API key, and the traffic is not encrypted "
              "(put a TLS proxy in front)", file=sys.stderr, flush=True)
    from pp_runtime.serve.server import serve  # fastapi and uvicorn: only for this command

    try:
        return serve(cfg, args.checkpoint, **options)
    except KeyboardInterrupt as exc:  # uvicorn stopped cleanly, then re-raised the signal
        print(f"pp-runtime serve: stopped ({interrupt.reason(exc)}); open requests were "
              "aborted and the workers released", file=sys.stderr)
        return interrupt.exit_code(exc)


def tcp_port(text: str) -> int:
    """--port's argparse `type=`: 0-65535 (0: any free one), named in argparse's one line."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; use 1-65535 (0: any free one)")
    return port


def check_flags(args) -> dict:
    """serve()'s keyword arguments from the flags (their ranges are checked as argparse
    parses them); ConfigError (exit 2) for a bad API key or an open host without one."""
    api_key = read_api_key(args.api_key, args.api_key_file)
    if api_key is None and not is_loopback(args.host):
        raise ConfigError(f"--host {args.host}: listening beyond this machine needs an API key "
                          f"(--api-key-file FILE, ${API_KEY_ENV} or --api-key)")
    return dict(host=args.host, port=args.port, api_key=api_key, max_waiting=args.max_waiting,
                max_body_bytes=int(args.max_body_mb * 2**20))


def read_api_key(flag: str | None, path: str | None) -> str | None:
    """The key from --api-key, else --api-key-file, else $PP_RUNTIME_API_KEY_FILE, else
    $PP_RUNTIME_API_KEY; None when none is set. An empty or unreadable file is an error."""
    if flag:
        return _one_key(flag, "--api-key")
    path = path or os.environ.get(API_KEY_FILE_ENV) or None
    if path:
        try:
            first = Path(path).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None
        return _one_key(first[0] if first else "", f"--api-key-file {path}")
    key = os.environ.get(API_KEY_ENV)
    return _one_key(key, f"${API_KEY_ENV}") if key else None


def _one_key(key: str, where: str) -> str:
    key = key.strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ConfigError(f"{where}: the API key must be one word of printable characters")
    return key


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or a name that resolves only to them (localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # unknown: listening will fail with its own message
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)
