"""Two socket rules every process group, test and benchmark shares (no torch).

- `free_port`: a TCP port free on an address now (bound and released; another process may
  take it before it is used, so a server that can should bind port 0 itself), never one of
  Ray's fixed default ports (a dashboard given 52365 collides with Ray's own agent).
- `keep_on_loopback`: with a loopback rendezvous address (one machine), gloo and NCCL
  listen on the loopback interface too, not on every interface; variables already set win.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import MutableMapping

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # gloo's and NCCL's interface


# Ray's fixed defaults: GCS, dashboard, dashboard agent (ray_constants); a kernel-chosen port
# can be any of them, and Ray then refuses to start ("used by other components")
RAY_DEFAULT_PORTS = frozenset({6379, 8265, 52365})


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that is free on addr now (bound and released), not one of RAY_DEFAULT_PORTS."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def is_loopback(addr: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost"."""
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux), if it has one."""
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)


def keep_on_loopback(addr: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Where `addr` is a loopback address, gloo and NCCL sockets use the loopback interface
    (`env.setdefault`: a variable the caller set wins). Call before the process group."""
    lo = loopback_interface() if is_loopback(addr) else None
    if lo:
        for name in IFNAME_VARIABLES:
            env.setdefault(name, lo)
