"""The command line: the README's main job, a small config, and clean errors."""
import json
from pathlib import Path
import subprocess
import sys

import pytest

from pp_runtime.telemetry.report import format_summary, read_report


def cli(*args):
    return subprocess.run([sys.executable, "-m", "pp_runtime.cli", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a Ray pipeline (pytest.ini)
def test_run_without_arguments_is_a_two_stage_ray_pipeline(tmp_path):
    # the README's first command, shortened: no --config, so the default deployment
    # (cpu/gpt2_pp2: GPT-2-small shapes, 2 stages as Ray actors on 127.0.0.1, gloo)
    r = cli("run", "--requests", "2", "--max-prompt", "300", "--max-tokens", "4",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("2 pipeline stages as 2 Ray actors on 127.0.0.1 (gloo, CPU")
    assert "gpt2-small shapes with random weights" in lines[0]
    # compiled_graph auto: off on this machine's 2 cores for 2 stages and the driver
    assert "on ray (2 actors, gloo, a task per actor)" in lines[1] and "pp=2" in lines[1]
    # Ray's own start-up lines (token authentication, "Started a local Ray instance") are in
    # the log the first line names, not before our lines
    log = Path(lines[0].rsplit("Ray's start-up output: ", 1)[1])
    assert "Started a local Ray instance" in log.read_text()
    assert "Token authentication" not in r.stderr and "Started a local Ray" not in r.stderr
    s = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert s["executor"] == "ray" and s["deployment"]["pp"] == 2 and s["deployment"]["tp"] == 1
    assert s["deployment"]["model"] == "gpt2-small"
    assert len(s["per_stage"]) == 2 and [p["stage"] for p in s["per_stage"]] == [0, 1]
    assert s["finish_reasons"] == {"length": 2}
    # the run ends with the report's summary (and its per-stage table), nothing after it
    assert r.stdout.rstrip().endswith(format_summary(read_report(tmp_path)).rstrip())


@pytest.mark.slow  # a Ray pipeline (pytest.ini)
def test_run_prints_one_line_per_microbatch_and_every_request(tmp_path):
    r = cli("run", "--config", "tiny", "--requests", "3", "--max-prompt", "70",
            "--max-tokens", "4", "--set", "pp=2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    mb_lines = [line for line in lines if line.startswith("mb ")]
    assert mb_lines and "prefill r0 [0:" in mb_lines[0]
    assert any("decodes (kv" in line and "prefill" in line for line in mb_lines)  # piggybacked
    assert sum(" length " in line for line in lines) == 3
    assert lines[0].startswith("2 pipeline stages as 2 Ray actors") and "pp=2" in lines[1]
    tok = next(i for i, line in enumerate(lines) if "tok/s" in line)
    assert tok > lines.index(mb_lines[-1]) and str(tmp_path) in lines[tok]
    # the summary comes last, after the requests and the token count
    assert r.stdout.rstrip().endswith(format_summary(read_report(tmp_path)).rstrip())


def test_bad_override_is_a_clear_error():
    r = cli("run", "--config", "tiny", "--set", "chunk_size=0")
    assert r.returncode == 2
    assert "planner.chunk_size: must be >= 1" in r.stderr and "Traceback" not in r.stderr


def test_memory_reports_the_papers_batch_size():
    r = cli("memory", "--config", "paper/gpt3_tp8_pp8")
    assert r.returncode == 0, r.stderr
    assert "27 per micro-batch" in r.stdout
    # the paged pool beside it: blocks per stage and requests in flight at the mean length
    assert "paged KV: 56208 blocks of 16 tokens per stage" in r.stdout  # the pool less one scratch block
    assert "410 requests in flight" in r.stdout and "219 whole contexts" in r.stdout


def test_memory_without_a_device_size_prints_the_configs_pool():
    r = cli("memory", "--config", "cpu/gpt2_pp2")
    assert r.returncode == 0, r.stderr
    assert "paged KV: 1024 blocks of 16 tokens per stage" in r.stdout and "16 whole contexts" in r.stdout


@pytest.mark.parametrize("setting, message", [
    ("block_size=24", "error: cache.block_size: 24 is not a power of two"),
    ("num_blocks=3", "error: cache.num_blocks: 3 blocks of 16 tokens hold less than one request"),
])
def test_bad_block_settings_are_one_line_and_exit_2(setting, message):
    r = cli("run", "--config", "tiny", "--set", setting)
    assert r.returncode == 2 and r.stderr.startswith(message), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_config_and_a_checkpoint_compose(tmp_path):
    """`run --config C --checkpoint D`: D's shapes and weights, C's parallel / planner /
    runtime sections (the config was dropped silently before); and `run --workload
    --checkpoint D` runs D's weights, not random ones: its tokens are transformers'."""
    import random

    import yaml
    from conftest import hf_model
    from test_hf_reference import hf_greedy

    model = hf_model("gpt")  # 3 layers, vocab 300, 128 positions
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    cfg = tmp_path / "two_stages.yaml"
    cfg.write_text(yaml.safe_dump({
        "parallel": {"pp": 2}, "runtime": {"executor": "local"},
        "planner": {"planner": "sarathi", "chunk_size": 8, "max_batch_size": 3, "tile_size": 8},
        "workload": {"kind": "fixed", "num_requests": 3, "prompt_len": 20, "output_len": 4,
                     "seed": 7}}))
    r = cli("run", "--config", str(cfg), "--checkpoint", str(ckpt), "--requests", "2",
            "--max-prompt", "30", "--max-tokens", "3", "--quiet", "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("2 pipeline stages in this process")
    assert f"config {cfg} + checkpoint {ckpt}" in r.stdout.splitlines()[0]
    saved = json.loads((tmp_path / "run" / "report.json").read_text())["config"]
    assert saved["parallel"]["pp"] == 2 and saved["planner"]["chunk_size"] == 8
    assert saved["model"]["vocab_size"] == 300 and saved["model"]["num_layers"] == 3

    r = cli("run", "--workload", "--config", str(cfg), "--checkpoint", str(ckpt), "--quiet",
            "--out", str(tmp_path / "workload"))
    assert r.returncode == 0, r.stderr
    rng = random.Random(7)  # run_workload's prompts: the workload seed, the model's vocabulary
    prompts = [[rng.randrange(300) for _ in range(20)] for _ in range(3)]
    outs = [json.loads(line) for line in (tmp_path / "workload" / "outputs.jsonl").read_text().splitlines()]
    assert [o["token_ids"] for o in outs] == [hf_greedy(model, p, 4) for p in prompts]


@pytest.mark.parametrize("sets, gpus, want", [
    ({}, 0, ("local", "cpu")), ({}, 1, ("local", "cuda")),
    ({"executor": "local", "device": "cpu"}, 4, ("local", "cpu")),
    ({"pp": 2}, 1, ("ray", "cpu")),  # a GPU for each of 2 workers, or none
    ({"pp": 2}, 2, ("ray", "cuda")), ({"pp": 2, "device": "cpu"}, 2, ("ray", "cpu")),
    ({"pp": 2, "ray_address": "10.0.0.1:6379"}, 0, ("ray", None)),  # the cluster decides
])
def test_one_decision_for_executor_and_device(sets, gpus, want, monkeypatch):
    """`executors.resolve` decides; `run`'s first line says what it decided, and
    `make_executor` starts what it names."""
    import argparse

    from pp_runtime import executors
    from pp_runtime.cli.run import what_runs
    from pp_runtime.config import load_config

    cfg = load_config("tiny", **sets)
    assert executors.resolve(cfg, gpus) == want
    monkeypatch.setattr(executors, "local_gpus", lambda: gpus)
    line = what_runs(cfg, argparse.Namespace(config="tiny", checkpoint=None))
    where = {("local", "cpu"): "in this process (cpu)", ("local", "cuda"): "in this process (cuda)",
             ("ray", "cpu"): "Ray actors on 127.0.0.1 (gloo, CPU",
             ("ray", "cuda"): "Ray actors on 127.0.0.1 (NCCL, one GPU each)",
             ("ray", None): "on the Ray cluster at 10.0.0.1:6379"}[want]
    assert where in line, line


def test_make_executor_starts_what_resolve_names(monkeypatch):
    from pp_runtime import executors
    from pp_runtime.config import ConfigError, load_config

    cfg = load_config("tiny", device="cpu")
    ex = executors.make_executor(cfg)
    assert ex.name == executors.resolve(cfg)[0] == "local"
    ex.shutdown()
    monkeypatch.setattr(executors, "resolve", lambda cfg, gpus=None: ("torchrun", "cpu"))
    with pytest.raises(ConfigError, match="torchrun runs inside torchrun"):
        executors.make_executor(cfg)
