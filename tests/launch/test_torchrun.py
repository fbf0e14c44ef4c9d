"""The torchrun launcher gives the same tokens and the same report files as the Ray executor.

torchrun's rendezvous store listens on every interface of its host, so the torchrun job
runs in a private network namespace (`unshare -n`) whose only interface is loopback."""
import json
import shutil
import subprocess
import sys

import pytest

WORKLOAD = ["--set", "workload.kind=fixed", "--set", "prompt_len=37", "--set", "output_len=6",
            "--requests", "5", "--set", "threads_per_worker=1"]


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    r = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    return r.returncode == 0


def torchrun(out, nproc, *args):
    cmd = (f"ip link set lo up && {sys.executable} -m torch.distributed.run --nnodes 1 "
           f"--nproc-per-node {nproc} --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29611 "
           f"-m pp_runtime.launch.torchrun --config tiny --quiet --out {out} " + " ".join(args))
    return subprocess.run(["unshare", "-n", "sh", "-c", cmd], capture_output=True, text=True,
                          timeout=300)


def ray_run(out, *args):
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", "run", "--config", "tiny",
                           "--workload", "--quiet", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


def outputs(d):
    return [json.loads(line) for line in (d / "outputs.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not _unshare_ok(), reason="needs unshare -n (a private network namespace)")
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_torchrun_and_ray_give_the_same_tokens_and_reports(tmp_path, tp, pp):
    par = ["--set", f"tp={tp}", "--set", f"pp={pp}"]
    r = torchrun(tmp_path / "torchrun", tp * pp, *WORKLOAD, *par)
    assert r.returncode == 0, r.stderr[-3000:]
    r = ray_run(tmp_path / "ray", *WORKLOAD, *par)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = outputs(tmp_path / "torchrun"), outputs(tmp_path / "ray")
    assert len(a) == 5 and all(len(o["token_ids"]) == 6 for o in a)
    assert a == b  # token for token
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
    assert names == {p.name for p in (tmp_path / "ray").iterdir()}


def test_a_wrong_world_size_is_a_clear_error(tmp_path):
    if not _unshare_ok():
        pytest.skip("needs unshare -n")
    r = torchrun(tmp_path, 2, "--set", "pp=1", *WORKLOAD)
    assert r.returncode != 0
    assert "torchrun started 2 processes, but parallel.tp x parallel.pp = 1 x 1" in r.stderr
