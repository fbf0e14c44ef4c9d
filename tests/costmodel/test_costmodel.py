"""The stage cost model: measured tables reproduced exactly, interpolation between them,
missing shapes scaled (and said so), the roofline by hand, placement of sends, stage
extras, monotonicity, and a local profile that takes precedence.

No torch, no GPU; the shipped tables are read from pp_runtime/costmodel/data/.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pp_runtime.config import Config, ModelConfig, load_model_config
from pp_runtime.costmodel import build_cost_model
from pp_runtime.costmodel.profiles import DATA_DIR
from pp_runtime.core.errors import ConfigError


def config(model: str | ModelConfig, **overrides) -> Config:
    m = load_model_config(model) if isinstance(model, str) else model
    return Config(model=m).with_overrides(**overrides)


def table_ms(op: str, tokens: int, n_embd=8192, n_kv_head=8, ffn=28672, tp=8,
             vocab=32768, device="a100") -> float:
    """One median (ms) of the shipped table, read straight from the CSV."""
    with open(DATA_DIR / f"{device}_mlp.csv", newline="") as fh:
        for r in csv.DictReader(fh):
            if (int(r["n_embd"]), int(r["n_kv_head"]), int(r["n_expanded_embd"]),
                    int(r["num_tensor_parallel_workers"]), int(r["vocab_size"]),
                    int(r["num_tokens"])) == (n_embd, n_kv_head, ffn, tp, vocab, tokens):
                return float(r[f"time_stats.{op}.median"])
    raise LookupError(op, tokens)


@pytest.fixture(scope="module")
def llama70():  # one layer per stage: breakdown() is per layer
    return build_cost_model(config("llama2-70b", tp=8, pp=80))


@pytest.fixture(scope="module")
def gpt3():  # the paper's deployment: TP8 x PP8 over 8 DGX A100 nodes, 12 layers a stage
    return build_cost_model(config("gpt3-175b", tp=8, pp=8, max_batch_size=27))


def test_the_cost_model_does_not_import_torch():
    code = ("import sys; from pp_runtime.costmodel import build_cost_model; "
            "from pp_runtime.config import Config; build_cost_model(Config()); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_measured_shape_reproduces_the_table_exactly(llama70):
    b = llama70.breakdown([(0, 256)], [])
    assert b["qkv_proj"] == pytest.approx(table_ms("attn_pre_proj", 256) * 1e-3, rel=1e-12)
    assert b["ffn_up"] == pytest.approx(table_ms("mlp_up_proj", 256) * 1e-3, rel=1e-12)
    # decodes count as tokens of the fused linear layers: 128 decodes = 128 tokens
    b = llama70.breakdown([], [100] * 128)
    assert b["ffn_down"] == pytest.approx(table_ms("mlp_down_proj", 128) * 1e-3, rel=1e-12)
    src = llama70.sources()
    assert "scaled" not in src["qkv_proj"] and "n_embd=8192 heads=64/8" in src["qkv_proj"]


def test_between_two_measured_token_counts_the_cost_is_interpolated(llama70):
    lo, hi = (table_ms("mlp_up_proj", n) * 1e-3 for n in (256, 264))
    mid = llama70.breakdown([(0, 260)], [])["ffn_up"]
    assert min(lo, hi) <= mid <= max(lo, hi)
    assert mid == pytest.approx((lo + hi) / 2, rel=1e-9)


def test_gpt3_is_scaled_from_the_nearest_measured_shape_and_says_so(gpt3):
    src = gpt3.sources()
    for op in ("qkv_proj", "out_proj", "ffn_up", "ffn_down"):
        assert "scaled to n_embd=12288" in src[op] and "roofline ratio" in src[op]
        assert "tp=8" in src[op]
    assert "n_embd=12288" in src["tp_all_reduce"] and "scaled" not in src["tp_all_reduce"]
    assert "scaled to 12 query / 12 KV heads" in src["attn_prefill"]


SANITY = {  # docs/costmodel.md, "Sanity numbers": (prefills, decodes) -> stage 1 ms, linear ms
    "chunk 256 + 26 decodes @ kv 2000": (([(0, 256)], [2000] * 26), 16.64, 9.83),
    "chunk 230 + 26 decodes @ kv 2000 (256 tokens)": (([(0, 230)], [2000] * 26), 14.99, 8.41),
    "chunk 256 alone": (([(0, 256)], []), 12.39, 8.41),
    "whole prefill of 2000 tokens": (([(0, 2000)], []), 69.78, 50.79),
    "27 decodes @ kv 2000": (([], [2000] * 27), 8.87, 4.35),
}
LINEAR = ("qkv_proj", "out_proj", "ffn_up", "ffn_act", "ffn_down")


def test_sanity_numbers_gpt3_tp8_a100(gpt3):
    """The numbers docs/costmodel.md quotes (stage 1, to 0.01 ms), and what they show: a
    micro-batch's linear ops are priced by its token count alone, a tile-aligned 256-token
    micro-batch is cheaper than 282 tokens, a 2000-token prefill costs 5-8x a 256-token
    chunk, and decodes alone cannot fall below the weights' and KV's ~5 ms floor."""
    ms = {}
    for name, ((pf, dec), stage_ms, linear_ms) in SANITY.items():
        t, parts = gpt3.stage_times(pf, dec), gpt3.breakdown(pf, dec)
        ms[name] = t[1] * 1e3
        assert ms[name] == pytest.approx(stage_ms, abs=0.006), name
        linear = sum(parts[op] for op in LINEAR) * 1e3  # the docs add up parts rounded to 0.01
        assert linear == pytest.approx(linear_ms, abs=0.03), name
    aligned, chunk = ms["chunk 230 + 26 decodes @ kv 2000 (256 tokens)"], ms["chunk 256 alone"]
    assert aligned < ms["chunk 256 + 26 decodes @ kv 2000"] and chunk < aligned
    assert 5 < ms["whole prefill of 2000 tokens"] / chunk < 2000 / 256
    assert 5 < ms["27 decodes @ kv 2000"] < chunk
    assert gpt3.send_time(256, 1) * 1e3 == pytest.approx(0.21, abs=0.006)  # across nodes


def test_roofline_only_device_matches_a_hand_computed_number():
    """Nothing measured fits hidden 1024 (tables start at 2560): everything is roofline."""
    m = ModelConfig(name="small", family="llama", num_layers=2, hidden_size=1024,
                    num_heads=16, num_kv_heads=4, ffn_size=2816, vocab_size=1000,
                    dtype="float16")
    cost = build_cost_model(config(m, tp=2, pp=2, gpu="h200"))
    src = cost.sources()
    for op in ("qkv_proj", "ffn_up", "other", "attn_prefill", "attn_decode", "embedding"):
        assert src[op] == "roofline h200"
    b = cost.breakdown([(0, 300)], [])  # stage 0 has 1 layer
    h, kv_width, tp = 1024, 4 * 64, 2
    n_out = (h + 2 * kv_width) // tp  # q, k, v columns of one rank
    flops = 2 * 384 * h * n_out  # 300 rows cost a whole tile of 128: 384
    nbytes = (300 * (h + n_out) + h * n_out) * 2
    assert b["qkv_proj"] == pytest.approx(max(flops / 989e12, nbytes / 4.8e12), rel=1e-12)
    assert flops / 989e12 > nbytes / 4.8e12  # this case is compute-bound
    dec = cost.breakdown([], [1000] * 4)["attn_decode"]  # memory-bound: K and V read once
    kv_bytes = 4000 * 2 * (kv_width // tp) * 2 + 2 * 4 * (h // tp) * 2
    assert dec == pytest.approx(kv_bytes / 4.8e12, rel=1e-12)


def test_a_send_between_nodes_costs_more_than_inside_one():
    one_node = build_cost_model(config("gpt3-175b", tp=4, pp=2, gpus_per_node=8))
    two_nodes = build_cost_model(config("gpt3-175b", tp=8, pp=2, gpus_per_node=8))
    same_tp = build_cost_model(config("gpt3-175b", tp=4, pp=4, gpus_per_node=8))
    assert not one_node.crosses_nodes(1) and two_nodes.crosses_nodes(1)
    assert [same_tp.crosses_nodes(s) for s in (1, 2, 3)] == [False, True, False]
    for tokens in (1, 256, 2048):
        assert same_tp.send_time(tokens, 2) > same_tp.send_time(tokens, 1) > 0
    with pytest.raises(ValueError):
        same_tp.send_time(256, 0)


def test_tp1_has_no_all_reduce_and_no_gather():
    cost = build_cost_model(config("llama-13b", tp=1, pp=2))
    assert "tp_all_reduce" not in cost.breakdown([(0, 256)], [])
    assert "tp_all_reduce" not in cost.sources() and "send_all_gather" not in cost.sources()
    tp2 = build_cost_model(config("llama-13b", tp=2, pp=2))
    assert tp2.breakdown([(0, 256)], [])["tp_all_reduce"] > 0


def test_stage_times_has_pp_entries_and_the_ends_carry_embedding_and_lm_head(gpt3):
    t = gpt3.stage_times([(0, 200)], [1000] * 20)
    b = gpt3.breakdown([(0, 200)], [1000] * 20)
    assert len(t) == 8 and t[1] == t[2] == t[6]  # 12 layers each
    assert t[0] - t[1] == pytest.approx(b["embedding"]) and b["embedding"] > 0
    assert t[7] > t[1] and "lm_head" not in b  # breakdown is of stage 0
    assert sum(b.values()) == pytest.approx(t[0], rel=1e-12)
    assert gpt3.microbatch_time([(0, 200)], [1000] * 20) == max(t)
    uneven = build_cost_model(config("llama-33b", tp=4, pp=8))  # 60 layers: 8 x4, 7 x4
    t = uneven.stage_times([(0, 256)], [])
    assert t[1] > t[4] and t[1] / t[4] == pytest.approx(8 / 7)
    whole = build_cost_model(config("llama-13b", tp=2, pp=1)).breakdown([(0, 64)], [5])
    assert whole["embedding"] > 0 and whole["lm_head"] > 0


@pytest.mark.parametrize("model,tp,gpu", [("llama2-70b", 8, "a100-80gb"),
                                          ("gpt3-175b", 8, "a100-80gb"),
                                          ("gpt3-175b", 8, "h200"), ("llama-33b", 4, "h100"),
                                          ("tiny-llama", 1, "a100-80gb")])
def test_cost_never_falls_as_tokens_or_keys_grow(model, tp, gpu):
    cost = build_cost_model(config(model, tp=tp, pp=2, gpu=gpu))
    f = cost.microbatch_time
    by_chunk = [f([(0, n)], []) for n in range(1, 4200)]  # past the precomputed tables
    assert all(a <= b for a, b in zip(by_chunk, by_chunk[1:]))
    by_start = [f([(s, 128)], []) for s in range(0, 4000, 7)]
    assert all(a < b for a, b in zip(by_start, by_start[1:]))
    by_decodes = [f([(0, 100)], [500] * d) for d in range(40)]
    assert all(a < b for a, b in zip(by_decodes, by_decodes[1:]))
    by_kv = [f([], [10, k, 300]) for k in range(1, 4000, 13)]
    assert all(a < b for a, b in zip(by_kv, by_kv[1:]))


def test_h200_carries_the_h100_tables_by_roofline_ratio():
    h100 = build_cost_model(config("llama2-70b", tp=8, pp=8, gpu="h100"))
    h200 = build_cost_model(config("llama2-70b", tp=8, pp=8, gpu="h200"))
    assert "scaled" not in h100.sources()["ffn_up"]
    assert "scaled h100 -> h200" in h200.sources()["ffn_up"]
    # decode batches are memory-bound: faster HBM, faster step; big chunks barely change
    assert h200.microbatch_time([], [1000] * 8) < h100.microbatch_time([], [1000] * 8)
    assert h200.microbatch_time([(0, 4096)], []) <= h100.microbatch_time([(0, 4096)], [])


# ---- a local profile ------------------------------------------------------------------
TINY = ModelConfig(name="t", family="llama", num_layers=2, hidden_size=64, num_heads=8,
                   num_kv_heads=2, ffn_size=160, vocab_size=512, max_positions=256)
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")


def write_profile(d: Path, n_embd=64) -> None:
    """A tiny profile of TINY at tp 1 on a CPU; every op costs `tokens` microseconds."""
    d.mkdir(parents=True, exist_ok=True)
    keys = dict(n_head=8, n_kv_head=2, n_embd=n_embd, n_expanded_embd=160, vocab_size=512,
                use_gated_mlp=True, num_tensor_parallel_workers=1)
    with open(d / "mlp.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, [*keys, "num_tokens", *(f"time_stats.{o}.median" for o in OPS)])
        w.writeheader()
        for n in (1, 64, 256):
            w.writerow({**keys, "num_tokens": n, **{f"time_stats.{o}.median": n / 1e3
                                                     for o in OPS}})
    cols = ["n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "batch_size",
            "prefill_chunk_size", "kv_cache_size", "is_prefill", "time_stats.attn_prefill.median",
            "time_stats.attn_decode.median"]
    with open(d / "attention.csv", "w", newline="") as fh:  # ms = 0.01 + n (1e-4 start + 1e-5 n)
        w = csv.writer(fh)
        w.writerow(cols)
        for n, k in ((16, 0), (64, 0), (64, 128), (128, 64), (32, 200)):
            w.writerow([n_embd, 8, 2, 1, 1, n, k, True, 0.01 + n * (1e-4 * k + 1e-5 * n), ""])
        for b, k in ((1, 10), (4, 100), (8, 50), (2, 200)):  # ms = 0.02 + 1e-5 * keys
            w.writerow([n_embd, 8, 2, 1, b, 0, k, False, "", 0.02 + 1e-5 * b * (k + 1)])
    (d / "device.json").write_text(json.dumps({"device": "cpu", "name": "test cpu",
                                               "dtype": "float32"}))


def test_a_local_profile_takes_precedence(tmp_path):
    write_profile(tmp_path / "prof")
    cost = build_cost_model(config(TINY, tp=1, pp=1, profile=str(tmp_path / "prof")))
    src = cost.sources()
    assert src["qkv_proj"].startswith(f"profile {tmp_path / 'prof' / 'mlp.csv'}")
    assert "attention.csv" in src["attn_prefill"]
    assert src["lm_head"].endswith("roofline cpu")  # the profile's device prices what it lacks
    b = cost.breakdown([(0, 64)], [])  # one stage of 2 layers
    assert b["qkv_proj"] == pytest.approx(2 * 64e-6) and b["ffn_up"] == pytest.approx(2 * 64e-6)
    assert b["other"] == pytest.approx(2 * 5 * 64e-6)  # 2 norms, 2 adds, rope
    assert b["embedding"] == pytest.approx(64e-6)
    assert b["attn_prefill"] == pytest.approx(2 * (0.01 + 64 * 1e-5 * 64) * 1e-3, rel=1e-6)
    dec = cost.breakdown([], [101, 51])["attn_decode"] / 2  # per layer
    assert dec == pytest.approx((0.02 + 1e-5 * 152) * 1e-3, rel=1e-6)


def test_a_missing_or_unfitting_profile_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="hardware.profile"):
        build_cost_model(config(TINY, profile=str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="hardware.profile"):
        build_cost_model(config(TINY, profile=str(tmp_path / "empty")))
    write_profile(tmp_path / "other", n_embd=128)  # another model's shape
    with pytest.raises(ConfigError, match="hardware.profile.*no rows for this model's shape"):
        build_cost_model(config(TINY, profile=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="hardware.gpu"):
        build_cost_model(config(TINY, gpu="tpu-v9"))


def test_the_shipped_tables_come_with_their_licence_and_origin():
    readme = (DATA_DIR / "README.md").read_text()
    assert (DATA_DIR / "LICENSE_vidur_MIT.txt").is_file() and "MIT" in readme
    for f in DATA_DIR.glob("*.csv"):
        assert f"`{f.name}`" in readme
