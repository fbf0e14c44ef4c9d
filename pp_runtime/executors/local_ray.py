"""A local Ray for the Ray executor: started on 127.0.0.1 (`start_ray`), its processes in
process groups of their own (`own_process_group`), its token file owner-only
(`owner_only_token`), and stopped with every process it started (`shutdown_ray`), so that
nothing is left running or listening after a run, an interrupt or a failure
(docs/errors.md). A Ray some other process started is never touched. What Ray itself
prints while it starts (its token-authentication warning, "Started a local Ray instance")
goes to a log (`start_log`, named by `pp-runtime run`'s first line), not the terminal;
its errors still reach the terminal (`output_to_log`)."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import sys
import tempfile
from pathlib import Path

from pp_runtime.core.interrupt import deferred

LOCAL_METRICS_INTERVAL_MS = 2000  # a local Ray's metrics reach /metrics within ~2 s (Ray: 10 s)
# a killed actor gets SIGKILL this long after SIGTERM (Ray: 5000 ms): a hung (stopped)
# stage ignores the SIGTERM, and its bundle frees only when the process is gone
LOCAL_KILL_TIMEOUT_MS = 1000


def start_log() -> Path:
    """Where this process's `start_ray` writes Ray's own start-up output (one per process:
    the first line of `pp-runtime run` names it before Ray starts)."""
    return Path(tempfile.gettempdir()) / f"pp_runtime-ray-start-{os.getpid()}.log"


_ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL|FATAL|Traceback)\b|^[EF]\d{4} ")  # logging, glog


@contextlib.contextmanager
def output_to_log(path: Path):
    """Inside the block, everything written to this process's stderr and stdout (Python's
    loggers, C++ glog lines, the processes started in it) goes to `path`, appended. After
    it, the log's error lines are echoed to stderr; on an exception, its last 40 lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = path.stat().st_size if path.exists() else 0
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    failed = True
    try:
        with open(path, "ab") as log:
            for fd in saved:
                os.dup2(log.fileno(), fd)
        yield path
        failed = False
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
        with contextlib.suppress(OSError):
            with open(path, "rb") as log:
                log.seek(start)
                lines = log.read().decode(errors="replace").splitlines()
            shown = lines[-40:] if failed else [ln for ln in lines if _ERROR_LINE.search(ln)]
            if shown:
                print(f"Ray's start-up log ({path}):", *shown, sep="\n", file=sys.stderr, flush=True)


def shutdown_ray() -> None:
    """`ray.shutdown()`, returning once the processes of a local Ray it started (GCS,
    raylet, agents, workers) have exited, those that outlive it stopped: a Ray interrupted
    in the middle of `ray.init` (Ctrl-C) is unknown to ray.shutdown, and its dashboard and
    runtime-env agents outlive the raylet and listen on for a minute."""
    import psutil  # Ray's own copy (ray/thirdparty_files) when psutil is not installed
    import ray

    procs = local_ray_processes()  # now: the agents leave the tree when the raylet exits
    ray.shutdown(wait_for_processes=True)
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        alive = [p for p in procs if _alive(p)]
        for p in alive:
            with contextlib.suppress(psutil.Error):
                stop(p)
        psutil.wait_procs(alive, timeout=3)


def local_ray_processes() -> list:
    """This process's descendants of the local Ray it started: those whose command line
    names its session (`session_<date>_<this pid>`: GCS, raylet, agents, dashboard) and
    their descendants (the workers). Never a Ray some other process started."""
    import psutil

    tag, found = f"_{os.getpid()}", {}
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("session_" in a and (a.endswith(tag) or f"{tag}/" in a) for a in proc.cmdline()):
                found.update({p.pid: p for p in [proc, *proc.children(recursive=True)]})
    return list(found.values())


def _alive(proc) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def start_ray(address: str | None, workers: int) -> None:
    """Join a cluster (`address`), or start a local Ray whose every port listens on
    127.0.0.1 with enough logical CPUs for one per worker, and whose processes push their
    metrics to the agent every 2 s instead of Ray's 10 s, and whose raylet sends SIGKILL
    1 s after the SIGTERM of a killed actor instead of 5 s (Ray's own variables
    `RAY_metrics_report_interval_ms` and `RAY_kill_worker_timeout_milliseconds`, when set,
    win; docs/monitoring.md, docs/recovery.md)."""
    import ray

    # Ctrl-C / SIGTERM wait for ray.init to return: an interrupt raised in one of its fork
    # hooks would be lost; and the SIGTERM handler it replaces comes back (core/interrupt.py)
    with deferred(), output_to_log(start_log()):
        if address is not None:
            ray.init(address=address, log_to_driver=True)
            return
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's own switch for 127.0.0.1 only
        os.environ.setdefault("RAY_metrics_report_interval_ms", str(LOCAL_METRICS_INTERVAL_MS))
        os.environ.setdefault("RAY_kill_worker_timeout_milliseconds", str(LOCAL_KILL_TIMEOUT_MS))
        owner_only_token()
        with own_process_group():
            ray.init(address="local",  # a new instance, never a head that `ray start` left running
                     num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False)


@contextlib.contextmanager
def own_process_group():
    """Ray's processes (GCS, raylet, and through the raylet its agents and the stage
    actors) started inside the block lead a process group of their own: a SIGTERM or
    SIGINT sent to our process group (Slurm, systemd, a container stop, a terminal) reaches
    this process only, which then stops them in order (`shutdown_ray`); they no longer die
    first and leave the driver waiting on a dead GCS. They still die with this process
    (Ray's PR_SET_PDEATHSIG), and `local_ray_processes` still finds them (descendants)."""
    from ray._private import services

    popen = services.ConsolePopen

    class OwnGroupPopen(popen):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = popen


def owner_only_token() -> Path | None:
    """The token file of a local Ray, readable by its owner only (mode 0600); its path.

    Ray 2.60 turns token authentication on for a new local cluster and, when there is no
    token, writes one to ~/.ray/auth_token with the process's umask: 0644, so every user of
    the machine could read it and run code on the cluster. Write it first, 0600 (a token as
    Ray makes one), or take the group and other bits off an existing one of ours. Nothing
    when the token comes from RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or auth is disabled."""
    if (os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"
            or "RAY_AUTH_TOKEN" in os.environ or "RAY_AUTH_TOKEN_PATH" in os.environ):
        return None
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = path.stat()
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            path.chmod(0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as ray get-auth-token --generate
    return path
