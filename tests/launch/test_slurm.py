"""slurm/ray_cluster.sbatch on a real one-node Slurm bound to 127.0.0.1.

The fixture installs Debian's Slurm and munge when they are missing (as root; otherwise the
test skips, saying why), starts munged, slurmctld and slurmd from a temp dir, and stops
them again whatever happens. The test submits the script with the tiny model on PP=2: a
Ray head started by `srun`, the pp-runtime driver joining it, two Ray actors over gloo.
It proves the job COMPLETED with exit code 0 and wrote a report of every request finished
by length on two pipeline stages. Deselect with `-m "not slurm"`.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pp_runtime.core.net import free_port

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
# this interpreter's bin first: the job scripts run `python` and `pp-runtime` from PATH, and
# in a virtualenv that is not activated the first ones on PATH are another install's
SBIN_PATH = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", ""),
                             "/usr/sbin", "/sbin"])
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "munged", "mungekey"]
APT_INSTALL = ("apt-get update && apt-get install -y --no-install-recommends "
               "slurmctld slurmd slurm-client munge")
REQUESTS = 4
JOB_TIMEOUT_S = 300
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"}


def which(name: str) -> str | None:
    return shutil.which(name, path=SBIN_PATH)


def install_slurm() -> None:
    """apt-get Slurm + munge when a binary is missing; skip (not fail) when that is impossible."""
    if all(which(b) for b in BINARIES):
        return
    if os.geteuid() != 0:
        pytest.skip("Slurm is not installed and installing it needs root")
    if not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and there is no apt-get to install it")
    r = subprocess.run(["bash", "-c", APT_INSTALL], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if r.returncode != 0 or not all(which(b) for b in BINARIES):
        pytest.skip(f"could not install Slurm ({APT_INSTALL}): {(r.stderr or r.stdout)[-500:]}")


def slurm_conf(d: Path) -> str:
    mem_mb = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20 * 0.85)
    return f"""\
ClusterName=pptest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=600
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=localhost CPUs=2 RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def run(cmd: list[str], env: dict, timeout: float = 30) -> str:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr or r.stdout}"
    return r.stdout


def stop_pid_file(pid_file: Path, timeout_s: float = 15) -> None:
    """SIGTERM the daemon named by pid_file and wait for it to go (SIGKILL at the end)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    stop_pid(pid, timeout_s)


def stop_pid(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains text (our temp dir): Ray processes this test started."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return [p for p in pids if p != os.getpid()]


@pytest.fixture
def slurm():
    """A one-node Slurm on 127.0.0.1 in a short temp dir (Ray's Unix sockets live under it);
    yields (environment for the Slurm commands, the dir)."""
    install_slurm()
    if os.geteuid() != 0:
        pytest.skip("slurmd has to run as root to start jobs")
    d = Path(tempfile.mkdtemp(prefix="pps-", dir="/tmp"))
    d.chmod(0o755)  # munged wants its socket's directory searchable by all
    for sub in ("state", "spool", "out"):
        (d / sub).mkdir()
    env = {**os.environ, "PATH": SBIN_PATH, "SLURM_CONF": str(d / "slurm.conf")}
    (d / "slurm.conf").write_text(slurm_conf(d))
    try:
        run([which("mungekey"), "-c", "-k", str(d / "munge.key")], env)
        os.chmod(d / "munge.key", 0o600)
        run([which("munged"), "-f", f"--key-file={d}/munge.key", "-S", str(d / "munge.socket"),
             f"--pid-file={d}/munged.pid", f"--seed-file={d}/munge.seed",
             f"--log-file={d}/munged.log"], env)  # forks into the background
        run([which("slurmctld"), "-c"], env)
        run([which("slurmd"), "-N", "localhost"], env)
        deadline = time.monotonic() + 30
        while run(["sinfo", "-h", "-o", "%T"], env).strip() != "idle":
            assert time.monotonic() < deadline, f"node not idle: {(d / 'slurmd.log').read_text()[-2000:]}"
            time.sleep(0.5)
        yield env, d
    finally:
        teardown(env, d)


def teardown(env: dict, d: Path) -> None:
    """Cancel our jobs, stop any Ray left under our dir, then slurmd, slurmctld, munged."""
    if (d / "slurmctld.pid").exists():
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h", "-t", "R,CG"], env=env, capture_output=True, text=True,
                timeout=30).stdout.strip():
            time.sleep(1)
    for pid in processes_mentioning(str(d / "ray")):
        stop_pid(pid, 5)
    for daemon in ("slurmd", "slurmctld", "munged"):
        stop_pid_file(d / f"{daemon}.pid")
    shutil.rmtree(d, ignore_errors=True)


def wait_for_job(job: str, env: dict, log: Path) -> dict:
    """Poll squeue until the job leaves the queue (sbatch --wait polls slowly); its fields
    from `scontrol show job`."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while run(["squeue", "-h", "-j", job, "-o", "%T"], env).strip() in ACTIVE:
        if time.monotonic() > deadline:
            pytest.fail(f"job {job} still running after {JOB_TIMEOUT_S} s:\n{tail(log)}")
        time.sleep(1)
    return dict(re.findall(r"(\w+)=(\S+)", run(["scontrol", "show", "job", job], env)))


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} missing)"


def test_ray_cluster_sbatch_runs_a_pp2_workload(slurm):
    env, d = slurm
    out, log = d / "out" / "run", d / "out" / "job.log"
    job_env = {**env, "CONFIG": "tiny", "OUT": str(out), "HEAD_IP": "127.0.0.1",
               "RAY_PORT": str(free_port()), "RAY_TEMP_DIR": str(d / "ray"),
               # another Ray on this machine may hold Ray's default client-server port
               "RAY_START_ARGS": f"--ray-client-server-port={free_port()}",
               "PP_ARGS": f"--requests {REQUESTS} --set pp=2 --set threads_per_worker=1 --quiet"}
    t0 = time.monotonic()
    job = run(["sbatch", "--parsable", "--nodes=1", f"--output={log}", f"--chdir={REPO}",
               str(REPO / "slurm" / "ray_cluster.sbatch")], job_env).strip().split(";")[0]
    fields = wait_for_job(job, env, log)
    print(f"job {job}: {fields.get('JobState')} exit {fields.get('ExitCode')} "
          f"in {time.monotonic() - t0:.1f} s\n{tail(log)}")

    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), tail(log)
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert summary["executor"] == "ray"
    assert summary["num_requests"] == REQUESTS
    assert summary["finish_reasons"] == {"length": REQUESTS}
    assert [s["stage"] for s in summary["per_stage"]] == [0, 1]
    assert not processes_mentioning(str(d / "ray")), "the job's trap left Ray processes behind"


def test_ray_cluster_sbatch_serve_mode_answers_a_load_run(slurm):
    """MODE=serve: `pp-runtime serve` on the head (tiny model, PP=2 Ray actors), the script
    waits for /health, then SERVE_CLIENT streams a short workload at it; the job's exit
    status is the client's and the trap stops the server and Ray."""
    pytest.importorskip("pp_runtime.serve", reason="pp-runtime serve is not there yet")
    env, d = slurm
    out, log = d / "out" / "bench", d / "out" / "job.log"
    client = (f"pp-runtime bench serve --url $SERVE_URL --config tiny --requests {REQUESTS} "
              f"--qps 4 --quiet --out {out}")
    job_env = {**env, "MODE": "serve", "CONFIG": "tiny", "HEAD_IP": "127.0.0.1",
               "SERVE_PORT": str(free_port()), "SERVE_CLIENT": client,
               "RAY_PORT": str(free_port()), "RAY_TEMP_DIR": str(d / "ray"), "RAY_DASHBOARD": "false",
               "RAY_START_ARGS": f"--ray-client-server-port={free_port()}",
               "PP_ARGS": "--set pp=2 --set threads_per_worker=1"}
    job = run(["sbatch", "--parsable", "--nodes=1", f"--output={log}", f"--chdir={REPO}",
               str(REPO / "slurm" / "ray_cluster.sbatch")], job_env).strip().split(";")[0]
    fields = wait_for_job(job, env, log)
    print(tail(log))

    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), tail(log)
    assert "pp-runtime serve ready: http://127.0.0.1:" in log.read_text()
    summary = json.loads((out / "loadgen.json").read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (REQUESTS, 0)
    assert not processes_mentioning(str(d / "ray")), "the job's trap left Ray processes behind"
