"""`measure_profile` writes a profile the cost model can load: Vidur's columns, one row per
grid point, positive times, one TP rank's shapes, and no processes left behind.

Two quick profiles of tiny models (GPT at tp=1, LLaMA with GQA at tp=2) are measured once
for the module; no test looks at timing ratios (the machine is shared and noisy).
"""
from __future__ import annotations

import csv
import json
import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch

from pp_runtime.config import Config
from pp_runtime.profile import p2p
from pp_runtime.profile.grid import profile_grid
from pp_runtime.profile.measure import (ATTENTION_COLUMNS, MLP_COLUMNS, MLP_OPS,
                                        SEND_RECV_COLUMNS, measure_profile, op_shapes)
from pp_runtime.core.errors import ConfigError

GPT = Config().with_overrides(num_layers=2, hidden_size=64, num_heads=4, vocab_size=256,
                              max_positions=256)
LLAMA_TP2 = GPT.with_overrides(family="llama", num_kv_heads=2, ffn_size=160, tp=2)
CONFIGS = {"gpt": GPT, "llama": LLAMA_TP2}
TABLES = {"mlp": MLP_COLUMNS, "attention": ATTENTION_COLUMNS, "send_recv": SEND_RECV_COLUMNS}


def _children() -> set[int]:
    """Live child processes of this one (multiprocessing's resource tracker excepted)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"resource_tracker" not in cmdline:
            pids.add(int(stat.parent.name))
    return pids


def _read(out: Path) -> dict:
    tables = {}
    for name in TABLES:
        with (out / f"{name}.csv").open(newline="") as f:
            reader = csv.DictReader(f)
            tables[name] = (tuple(reader.fieldnames), list(reader))
    tables["device"] = json.loads((out / "device.json").read_text())
    return tables


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    torch.set_num_threads(1)
    before = _children()
    read = {name: _read(measure_profile(cfg, tmp_path_factory.mktemp(name), quick=True,
                                        progress=False))
            for name, cfg in CONFIGS.items()}
    return read, before, _children()


@pytest.mark.parametrize("name", CONFIGS)
def test_tables_have_exactly_the_vidur_columns(profiles, name):
    for table, columns in TABLES.items():
        assert profiles[0][name][table][0] == columns, table


@pytest.mark.parametrize("name", CONFIGS)
def test_one_row_per_grid_point(profiles, name):
    tables, grid = profiles[0][name], profile_grid(CONFIGS[name], quick=True)
    mlp, attention, send = (tables[t][1] for t in TABLES)
    assert [int(r["num_tokens"]) for r in mlp] == list(grid.num_tokens)
    prefills = [(int(r["prefill_chunk_size"]), int(r["kv_cache_size"]))
                for r in attention if r["is_prefill"] == "True"]
    decodes = [(int(r["batch_size"]), int(r["kv_cache_size"]))
               for r in attention if r["is_prefill"] == "False"]
    assert prefills == list(grid.prefills) and decodes == list(grid.decodes)
    assert len(prefills) + len(decodes) == len(attention)
    assert [int(r["num_tokens"]) for r in send] == list(grid.send_tokens)
    assert len(grid.prefills) >= 3 and len(grid.decodes) >= 3 and len(grid.num_tokens) >= 4


def test_grid_is_capped_by_sequence_length_and_batch_size():
    grid, L, B = profile_grid(GPT, quick=False), GPT.seq_len, GPT.batch_rows
    assert max(grid.num_tokens) == L + B and 1 in grid.num_tokens
    assert all(c + k <= L for c, k in grid.prefills) and (L, 0) in grid.prefills
    assert {k for _, k in grid.prefills} >= {0, 128}  # chunks after cached tokens, too
    assert all(1 <= k <= L - 1 for _, k in grid.decodes)  # a decode attends to k + 1 keys
    assert max(b for b, _ in grid.decodes) == B
    assert len(profile_grid(GPT, quick=True).num_tokens) < len(grid.num_tokens)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_time_is_positive(profiles, name):
    tables = profiles[0][name]
    for row in tables["mlp"][1]:
        for op in MLP_OPS:
            t = float(row[f"time_stats.{op}.median"])
            assert t == 0.0 if (op == "attn_rope" and name == "gpt") else t > 0, (op, row)
    for row in tables["attention"][1]:
        prefill = row["is_prefill"] == "True"
        used, unused = ("prefill", "decode") if prefill else ("decode", "prefill")
        assert float(row[f"time_stats.attn_{used}.median"]) > 0
        assert row[f"time_stats.attn_{unused}.median"] == ""
    assert all(float(r["time_stats.send_recv.median"]) > 0 for r in tables["send_recv"][1])


def test_llama_is_gated_and_pays_for_rope(profiles):
    rows = profiles[0]["llama"]["mlp"][1]
    assert all(r["use_gated_mlp"] == "True" and float(r["time_stats.attn_rope.median"]) > 0
               for r in rows)
    assert all(r["use_gated_mlp"] == "False" for r in profiles[0]["gpt"]["mlp"][1])


def test_tp2_rows_name_the_full_model_and_time_one_rank(profiles):
    tables = profiles[0]["llama"]
    for table in TABLES:
        assert {r["num_tensor_parallel_workers"] for r in tables[table][1]} == {"2"}
    assert {(r["n_head"], r["n_kv_head"], r["n_embd"], r["n_expanded_embd"])
            for r in tables["mlp"][1]} == {("4", "2", "64", "160")}
    assert {r["n_embd"] for r in tables["send_recv"][1]} == {"64"}
    head_dim = 16
    shapes = op_shapes(LLAMA_TP2)  # heads 4/2, KV heads 2/2, ffn 160/2 per rank
    assert shapes["attn_pre_proj"] == ((2 + 2 * 1) * head_dim, 64)
    assert shapes["attn_post_proj"] == (64, 2 * head_dim)
    assert shapes["mlp_up_proj"] == (2 * 80, 64)  # gate and up, 80 wide each
    assert shapes["mlp_down_proj"] == (64, 80)
    gpt_tp2 = op_shapes(GPT.with_overrides(tp=2))
    assert gpt_tp2["mlp_up_proj"] == (128, 64) and gpt_tp2["attn_pre_proj"] == (96, 64)
    assert op_shapes(GPT)["mlp_up_proj"] == (256, 64)


def test_device_json_says_what_was_measured_where(profiles):
    info = profiles[0]["llama"]["device"]
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["tp"] == 2
    assert info["threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert info["model"] == LLAMA_TP2.model.name and info["name"] and info["measured_at"]


def test_send_recv_processes_are_gone_afterwards(profiles):
    _, before, after = profiles
    assert multiprocessing.active_children() == []
    if Path("/proc/self/stat").exists():
        assert after == before


def test_quiet_without_progress(tmp_path, capfd):
    measure_profile(GPT.with_overrides(max_positions=64), tmp_path, quick=True, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_failed_send_recv_raises_and_leaves_no_process(tmp_path, monkeypatch):
    """Rank 0 cannot bind its store's port (someone listens there): a clear error, fast."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(p2p, "free_port", lambda addr: taken.getsockname()[1])
        before = _children()
        with pytest.raises(RuntimeError, match="send/recv: rank 0 failed"):
            measure_profile(GPT.with_overrides(max_positions=32), tmp_path, quick=True,
                            progress=False)
    assert multiprocessing.active_children() == [] and _children() == before
    assert not (tmp_path / "mlp.csv").exists()  # nothing half-written


def test_bad_output_and_config_raise_config_error(tmp_path):
    a_file = tmp_path / "profile.txt"
    a_file.write_text("not a directory")
    with pytest.raises(ConfigError, match="is a file"):
        measure_profile(GPT, a_file, quick=True, progress=False)
    with pytest.raises(ConfigError, match="cannot be created"):
        measure_profile(GPT, a_file / "sub", quick=True, progress=False)
    with pytest.raises(ConfigError, match="needs a Config"):
        measure_profile({"model": "tiny"}, tmp_path, quick=True, progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            measure_profile(GPT.with_overrides(device="cuda"), tmp_path, quick=True,
                            progress=False)


@pytest.mark.parametrize("levers", [True, False], ids=["cpu-levers", "plain"])
def test_the_profile_times_the_kernels_the_workers_run(tmp_path, monkeypatch, levers):
    """With the CPU levers on, the profile's matmuls run prepacked and its decodes go through
    the C++ kernel, as a worker's would (docs/performance.md); with them off, neither."""
    from pp_runtime.model import cpu_kernels
    from pp_runtime.model.attention import attention_paths

    if levers and cpu_kernels.decode_extension() is None:
        pytest.skip("no C++ compiler here")
    packed_calls = []
    real = cpu_kernels.PackedLinear.forward
    monkeypatch.setattr(cpu_kernels.PackedLinear, "forward",
                        lambda self, x: packed_calls.append(1) or real(self, x))
    cfg = GPT.with_overrides(max_positions=64, prepack=levers, cpu_decode_kernel=levers)
    before = attention_paths()
    measure_profile(cfg, tmp_path, quick=True, progress=False)
    after = attention_paths()
    ran = {path: after[path] - before[path] for path in ("decode_cpu", "decode_views")}
    assert (ran["decode_cpu"] > 0, ran["decode_views"] > 0) == (levers, not levers)
    assert bool(packed_calls) == (levers and cpu_kernels.can_prepack(torch.float32))
