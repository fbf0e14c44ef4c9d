"""torchrun whose stores listen on one address only: `python -m pp_runtime.cli.agent`.

    python -m pp_runtime.cli.agent --nnodes N --nproc-per-node G --rdzv-backend c10d \\
        --rdzv-endpoint IP:PORT [--local-addr IP] -m pp_runtime.cli.torchrun --config FILE

Takes torchrun's own arguments and runs torchrun. torch's TCPStore server listens on every
interface (`*:PORT`, IPv4 and IPv6) whatever host it is given, and torchrun's agent starts
two: the c10d rendezvous store (on the `--rdzv-endpoint` port of the host node) and the
store its workers bootstrap from (`MASTER_ADDR:MASTER_PORT`, a free port on the node of
rank 0). Here both get a socket bound first to their own address (the endpoint's IP, and
`--local-addr`) and handed over as `master_listen_fd`, as `parallel/groups.py` does for the
Ray executor. `--local-addr` defaults to the address this node reaches the endpoint from
(127.0.0.1 for a loopback endpoint). The endpoint must be an IP address (a host name may
resolve to a loopback address on its own host) and the backend c10d, and the agent must
keep the bootstrap store (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with it, rank 0's worker
starts that store through `env://`, on every interface).

This patches two private places of torch (checked at start: a torch without them stops
here rather than listen everywhere). docs/distributed.md says what listens where.

A third patch, for recovery (docs/recovery.md): when the agent stops its workers (a restart,
or the job's end) it signals each worker's process group and waits up to 30 s before
SIGKILL; a worker stopped with SIGSTOP (a hang) never takes that SIGTERM, so every such
restart waited the full 30 s. Here the SIGTERM is followed by SIGCONT: the stopped worker
resumes, takes the SIGTERM and exits at once. Without that place in torch, nothing changes
but the wait.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys

from torch.distributed import TCPStore
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint


def bound_store(host: str, port: int, *args, is_master: bool = False, **kwargs) -> TCPStore:
    """TCPStore(host, port, ...) whose server, if it is one, listens on host only."""
    if not is_master or kwargs.get("master_listen_fd") is not None:
        return TCPStore(host, port, *args, is_master=is_master, **kwargs)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)  # SO_REUSEADDR, listening
    except OSError as exc:  # RuntimeError: the c10d backend then tries as a client
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from exc
    port = sock.getsockname()[1]
    return TCPStore(host, port, *args, is_master=True, master_listen_fd=sock.detach(), **kwargs)


def _bootstrap_store(self, master_addr: str, master_port: int) -> TCPStore:
    return bound_store(master_addr, master_port, is_master=True, multi_tenant=True)


def route_source(host: str) -> str:
    """The local address this node sends from to reach host (no packet leaves)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def check_args(argv: list[str]) -> list[str]:
    """torchrun's argv with --local-addr filled in; SystemExit with the reason if this
    launcher cannot keep the stores on one address."""
    args = torchrun.get_args_parser().parse_args(argv)
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        sys.exit("error: give --rdzv-backend c10d --rdzv-endpoint IP:PORT (127.0.0.1:PORT on "
                 "one machine): only the c10d backend's store is bound here")
    host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    if not _is_ip(host):
        sys.exit(f"error: --rdzv-endpoint host {host!r} must be an IP address: the store "
                 "listens on exactly that address")
    if args.local_addr is None:
        try:
            argv = ["--local-addr", route_source(host), *argv]
        except OSError as exc:
            sys.exit(f"error: no route from this node to {host} ({exc}); give --local-addr")
    elif not _is_ip(args.local_addr):
        sys.exit(f"error: --local-addr {args.local_addr!r} must be an IP address")
    return argv


def patch_torch() -> None:
    """Make torchrun's agent create both of its stores through `bound_store`."""
    if not (hasattr(c10d_backend, "TCPStore") and hasattr(c10d_backend, "_create_tcp_store")
            and hasattr(DynamicRendezvousHandler, "_create_tcp_store_server")):
        sys.exit("error: this torch creates torchrun's stores elsewhere; pp_runtime.cli.agent "
                 "cannot bind them (run plain torchrun inside the cluster network)")
    c10d_backend.TCPStore = bound_store
    DynamicRendezvousHandler._create_tcp_store_server = _bootstrap_store


def _handler_class():
    """torch's SubprocessHandler (one worker process under the agent), or None."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
    except ImportError:
        return None
    cls = getattr(subprocess_handler, "SubprocessHandler", None)
    return cls if cls is not None and hasattr(cls, "close") else None


def patch_stop() -> None:
    """The agent's signal to a worker's process group is followed by SIGCONT (module doc)."""
    cls = _handler_class()
    if cls is None or getattr(cls.close, "continues", False) or not hasattr(os, "killpg"):
        return
    close = cls.close

    def close_and_continue(self, death_sig=None) -> None:
        close(self, death_sig)
        if death_sig != signal.SIGKILL:
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped worker takes its signal
            except (ProcessLookupError, PermissionError):
                pass
    close_and_continue.continues = True
    cls.close = close_and_continue


def main(argv: list[str] | None = None) -> None:
    argv = check_args(sys.argv[1:] if argv is None else argv)
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        sys.exit("error: unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with it rank 0's worker "
                 "starts the bootstrap store itself, on every interface")
    patch_torch()
    patch_stop()
    torchrun.main(argv)


if __name__ == "__main__":
    main()
