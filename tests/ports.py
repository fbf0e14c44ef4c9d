"""A free TCP port on 127.0.0.1 for a test's server, Ray dashboard, Prometheus or Slurm
daemon: one helper for every test folder (this folder is on pytest's pythonpath), the
package's own rule (`pp_runtime.parallel.groups.free_port`)."""
from pp_runtime.parallel.groups import free_port as _free_port


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now (bound and released)."""
    return _free_port(host)
