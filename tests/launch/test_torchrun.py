"""The torchrun launcher gives the same tokens and the same report files as the Ray executor,
with every port it opens on 127.0.0.1.

The job runs under `pp_runtime.cli.agent` (torchrun with its stores bound to one
address) in a private network namespace (`unshare -n`) whose only interface is loopback,
so that even a store listening on every interface would reach nothing outside; `ss`
polled inside that namespace while the job runs proves nothing listens beyond 127.0.0.1.
"""
import json
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow  # Ray actors or torchrun processes (pytest.ini)

WORKLOAD = ["--set", "workload.kind=fixed", "--set", "prompt_len=37", "--set", "output_len=6",
            "--requests", "5", "--set", "threads_per_worker=1"]


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    r = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return r.returncode == 0


def torchrun(out, nproc, *args):
    """Run the launcher under the agent in a private network namespace; the listening
    sockets `ss` saw meanwhile are written to `{out}.listen`."""
    job = (f"{sys.executable} -m pp_runtime.cli.agent --nnodes 1 --nproc-per-node {nproc} "
           f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29611 "
           f"-m pp_runtime.cli.torchrun --config tiny --quiet --out {out} " + " ".join(args))
    cmd = (f"ip link set lo up && {{ {job} & }}; pid=$!; touch {out}.listen; "
           f"while kill -0 $pid 2>/dev/null; do ss -ltnH >> {out}.listen; sleep 0.2; done; "
           f"wait $pid")
    return subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True,
                          timeout=300)


def listeners(out) -> set[str]:
    """Local addresses (ADDR:PORT) of the listening TCP sockets seen during the job."""
    text = (out.parent / f"{out.name}.listen").read_text()
    return {line.split()[3] for line in text.splitlines() if line.strip()}


def ray_run(out, *args):
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", "run", "--config", "tiny",
                           "--workload", "--quiet", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


def outputs(d):
    return [json.loads(line) for line in (d / "outputs.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not _unshare_ok(), reason="needs unshare -n (a private network namespace)")
# 1 x 2 (25-40 s in the suite) runs apart (-m heavy): its token hop is token-exact against
# one process on torchrun at PP = 3 (test_torchrun_token_hop.py) and on Ray at PP = 2 and 3
# (tests/parallel/test_token_hop.py), and 2 x 2 compares the two launchers' tokens and reports
@pytest.mark.parametrize("tp, pp", [pytest.param(1, 2, marks=pytest.mark.heavy), (2, 2)])
def test_torchrun_and_ray_give_the_same_tokens_and_reports(tmp_path, tp, pp):
    par = ["--set", f"tp={tp}", "--set", f"pp={pp}"]
    r = torchrun(tmp_path / "torchrun", tp * pp, *WORKLOAD, *par)
    assert r.returncode == 0, r.stderr[-3000:]
    if shutil.which("ss"):  # the rendezvous store, the bootstrap store, gloo: all on loopback
        seen = listeners(tmp_path / "torchrun")
        assert "127.0.0.1:29611" in seen and len(seen) >= 3, seen
        assert all(a.startswith("127.0.0.1:") for a in seen), seen
    r = ray_run(tmp_path / "ray", *WORKLOAD, *par)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = outputs(tmp_path / "torchrun"), outputs(tmp_path / "ray")
    assert len(a) == 5 and all(len(o["token_ids"]) == 6 for o in a)
    assert a == b  # token for token
    if tp == 1:  # the token hop (on by default at tp = 1 on both) gives one process's tokens
        # (PP = 3: tests/launch/test_torchrun_token_hop.py)
        r = ray_run(tmp_path / "one", *WORKLOAD, "--set", "executor=local", "--set", "pp=1")
        assert r.returncode == 0, r.stderr[-3000:]
        assert a == outputs(tmp_path / "one")
    ra, rb = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("torchrun", "ray"))
    assert (ra["summary"]["executor"], rb["summary"]["executor"]) == ("torchrun", "ray")
    assert set(ra["summary"]) == set(rb["summary"])
    assert [st["stage"] for st in ra["summary"]["per_stage"]] == list(range(pp))
    for st in ra["summary"]["per_stage"]:  # the same rule, every cause (docs/bubbles.md)
        causes = st["bubble_by_cause_s"]
        assert set(causes) == {"upstream", "downstream", "dependency"}
        assert st["busy_s"] + st["transfer_s"] + sum(causes.values()) + st["idle_s"] == \
            pytest.approx(st["wall_s"])
    assert ra["summary"]["per_stage"][0]["bubble_by_cause_s"]["dependency"] > 0
    assert all(r["bubble_s"] >= 0 and r["num_microbatches"] > 0 for r in ra["requests"])
    names = {p.name for p in (tmp_path / "torchrun").iterdir()}
    assert names == {p.name for p in (tmp_path / "ray").iterdir()} | {"journal.jsonl"}


def test_a_wrong_world_size_is_a_clear_error(tmp_path):
    if not _unshare_ok():
        pytest.skip("needs unshare -n")
    r = torchrun(tmp_path, 2, "--set", "pp=1", *WORKLOAD)
    assert r.returncode != 0
    assert "torchrun started 2 processes, but parallel.tp x parallel.pp = 1 x 1" in r.stderr


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2)")
def test_a_torch_store_listens_everywhere_but_a_bound_one_on_its_address():
    """What the agent fixes: torch's TCPStore server ignores its host and listens on every
    interface (`*:PORT`); `bound_store` listens on the address it is given."""
    import torch.distributed as dist

    from pp_runtime.cli.agent import bound_store

    def local_addrs(port):
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                             text=True, check=True).stdout
        return {line.split()[3] for line in out.splitlines()}

    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert local_addrs(plain.port) == {f"*:{plain.port}"}
    bound = bound_store("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert local_addrs(bound.port) == {f"127.0.0.1:{bound.port}"}
    client = dist.TCPStore("127.0.0.1", bound.port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert bound.get("k") == b"v"


@pytest.mark.parametrize("argv, reason", [
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29500"], "must be an IP address"),
    (["--rdzv-backend", "static", "--master-addr", "127.0.0.1"], "give --rdzv-backend c10d"),
    (["--standalone"], "give --rdzv-backend c10d"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "--local-addr", "node1"],
     "--local-addr 'node1' must be an IP address"),
])
def test_the_agent_refuses_what_it_cannot_bind(argv, reason):
    from pp_runtime.cli.agent import check_args

    with pytest.raises(SystemExit) as exc:
        check_args([*argv, "-m", "pp_runtime.cli.torchrun"])
    assert reason in str(exc.value.code)


def test_the_agent_refuses_a_worker_side_bootstrap_store(monkeypatch):
    from pp_runtime.cli import agent

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setattr(agent, "patch_torch", lambda: pytest.fail("went on"))
    with pytest.raises(SystemExit, match="unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        agent.main(["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "-m", "x"])


def test_the_agent_takes_local_addr_from_the_route_to_the_endpoint():
    from pp_runtime.cli.agent import check_args

    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "-m", "x"]
    assert check_args(argv) == ["--local-addr", "127.0.0.1", *argv]
    given = ["--local-addr", "127.0.0.5", *argv]
    assert check_args(given) == given
