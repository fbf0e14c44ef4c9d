"""`pp-runtime plan`'s frontier, cache and two search paths, end to end on a toy cluster.

The toy: GPT-2 small on two A100s in one node, 512-token prompts, 32 output tokens.
Two whole replicas (tp1 x2) send no activation anywhere, so they carry the most per GPU;
one model cut across both GPUs by tensor parallelism (tp2 x1) halves every matmul of a
token, so its tokens come fastest (the lowest p99 TBT) at the price of an all-reduce per
layer and half the work per GPU. Each wins one end of the frontier.
"""
import json
import subprocess
import sys

import pytest

from pp_runtime.config import load_config

PLAN = [sys.executable, "-m", "pp_runtime.cli", "plan"]
TOY = ["--model", "gpt2-small", "--gpus", "2", "--gpus-per-node", "2", "--workload",
       "fixed:prompt_len=512,output_len=32", "--requests", "40", "--chunk-sizes", "512",
       "--planners", "sarathi", "--ttft-slo", "0.1", "--tbt-slo", "0.01", "--jobs", "2", "--quiet"]


def plan(out, *extra, timeout=600):
    done = subprocess.run(PLAN + TOY + ["--out", str(out), *extra], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    return done.stdout, json.loads((out / "plan.json").read_text())


def probes_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if " probes, " in line)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    first = plan(root / "fast", "--cache", str(root / "cache"))
    again = plan(root / "again", "--cache", str(root / "cache"))
    return root, first, again


def test_two_layouts_each_win_one_end_of_the_frontier(toy):
    root, (stdout, data), _ = toy
    front = data["frontier"]
    names = [f["deployment"].split(" sarathi")[0] for f in front]
    assert names[0] == "tp1 pp1 x2" and data["best"].startswith("tp1 pp1 x2"), stdout
    lowest_tbt = min(front, key=lambda f: f["tbt_p99_s"])
    assert lowest_tbt["deployment"].startswith("tp2 pp1 x1"), stdout
    assert front[0]["per_gpu"] > lowest_tbt["per_gpu"]  # throughput for latency: a trade
    assert "<- the SLO's winner" in stdout.split("frontier:")[1].splitlines()[3], stdout
    for i, f in enumerate(front, 1):  # one runnable config per point, at its rate
        cfg = load_config(root / "fast" / "frontier" / f"{i:02d}.yaml")
        assert cfg.workload.qps is not None and cfg.parallel.tp * cfg.parallel.pp <= 2
    assert (root / "fast" / "frontier.png").stat().st_size > 10_000


def test_a_second_identical_search_simulates_nothing(toy):
    _, (first, data), (again, data2) = toy
    asked, simulated = (int(x) for x in probes_line(first).split()[0:3:2])
    assert simulated > 0, first  # (the fast path's last phase reads its own probes back)
    assert probes_line(again).startswith(f"{asked} probes, 0 simulated, {asked} read from the cache")
    assert data2["best"] == data["best"] and data2["frontier"] == data["frontier"]


def test_fast_and_exhaustive_paths_agree(toy, tmp_path):
    _, (stdout, fast), _ = toy
    slow_out, slow = plan(tmp_path, "--exhaustive", "--no-cache")
    assert slow["best"] == fast["best"]
    assert slow["frontier"] == fast["frontier"]
    asked_fast, asked_slow = int(probes_line(stdout).split()[0]), int(probes_line(slow_out).split()[0])
    assert asked_fast <= asked_slow, (stdout, slow_out)  # and the fast path asked no more
