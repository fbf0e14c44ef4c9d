"""benchmarks/vs_vllm.py's bookkeeping, without vLLM or a model: the cores each vLLM rank
gets, TTFT from vLLM's per-request stats, token agreement, best-of-runs and row groups."""
import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


vs_vllm, vllm_side = _load("vs_vllm"), _load("vllm_side")


def test_vllm_ranks_get_the_cores_ours_get():
    assert vllm_side.launcher_env(1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert vllm_side.launcher_env(2, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    env = vllm_side.launcher_env(2, 1)
    assert env["VLLM_HOST_IP"] == env["MASTER_ADDR"] == "127.0.0.1"


def test_vllm_ttft_counts_from_the_call_not_the_arrival():
    late = SimpleNamespace(metrics=SimpleNamespace(arrival_time=100.5, first_token_latency=2.0))
    assert vllm_side.ttfts([late], t0=100.0) == [2.5]


def test_agreement_counts_requests_and_positions():
    a = vs_vllm.agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert a == dict(identical_requests=1, requests=2, agreeing_tokens=4, tokens=5)


def test_best_takes_top_throughput_and_lowest_ttft():
    runs = [vs_vllm.measurement("vLLM", "vLLM", 1, i, [[0] * 10], s, [t])
            for i, (s, t) in enumerate([(2.0, 0.5), (1.0, 0.9)], 1)]
    top = vs_vllm.best(runs)
    assert (top["run"], top["tok_s"], top["ttft_p50_s"]) == ("best", 10.0, 0.5)


def test_ours_groups_apply_set_first_then_their_own():
    args = argparse.Namespace(set=["chunk_size=128"], label="x",
                              ours=["base:runtime.prepack=false,chunk_size=64", "all:"])
    assert vs_vllm.our_groups(args) == [("base", {"chunk_size": 64, "runtime.prepack": False}),
                                        ("all", {"chunk_size": 128})]
    args.ours = []
    assert vs_vllm.our_groups(args) == [("x", {"chunk_size": 128})]
