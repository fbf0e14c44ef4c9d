"""Every bad input a user can give, one table per entry point (issue 14): exit code 2, one
line naming the input (file and line, flag, field or request index), no traceback, nothing
run, and a good call afterwards works."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pp_runtime import LLM, InvalidRequestError, SamplingParams
from pp_runtime.cli.main import main
from pp_runtime.core.request import check_requests
from pp_runtime.telemetry.report import read_report, strict_json

TRACE_LINE = '{{"arrival_s": {a}, "prompt_len": {p}, "output_len": 2}}\n'


def trace(tmp_path: Path, name: str, a="0", p="10") -> str:
    path = tmp_path / name
    path.write_text(TRACE_LINE.format(a=a, p=p))
    return str(path)


def cli_error(capsys, *argv) -> str:
    """Run the CLI in this process; it must exit 2 with one `error:` line naming the input."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


SIM = ("simulate", "--config", "tiny", "--quiet")


def sim_trace(path: str) -> tuple:
    return (*SIM, "--set", "workload.kind=trace", "--set", f"workload.trace={path}")


# (argv builder given tmp_path, text the message must contain)
CLI_CASES = {
    "trace-nan-arrival": (lambda t: sim_trace(trace(t, "nan.jsonl", a="NaN")),
                          ["nan.jsonl:1", "NaN"]),
    "trace-inf-arrival": (lambda t: sim_trace(trace(t, "inf.jsonl", a="Infinity")),
                          ["inf.jsonl:1", "Infinity"]),
    "trace-negative-arrival": (lambda t: sim_trace(trace(t, "neg.jsonl", a="-1")),
                               ["neg.jsonl:1", "arrival_s must be a finite number"]),
    "trace-missing": (lambda t: sim_trace(str(t / "missing.jsonl")),
                      ["workload.trace", "missing.jsonl is not found"]),
    "trace-is-a-directory": (lambda t: sim_trace(str(t)), ["workload.trace", "is a directory"]),
    "trace-fractional-length": (lambda t: sim_trace(trace(t, "f.jsonl", p="10.7")),
                                ["f.jsonl:1", "prompt_len must be a whole number", "10.7"]),
    "trace-bool-length": (lambda t: sim_trace(trace(t, "b.jsonl", p="true")),
                          ["b.jsonl:1", "prompt_len", "True"]),
    "trace-string-length": (lambda t: sim_trace(trace(t, "s.jsonl", p='"4"')),
                            ["s.jsonl:1", "prompt_len", "'4'"]),
    "trace-not-json": (lambda t: sim_trace(str(_write(t / "x.jsonl", "{arrival_s: 0}\n"))),
                       ["x.jsonl:1", "not valid JSON"]),
    "trace-empty": (lambda t: sim_trace(str(_write(t / "e.jsonl", "\n"))), ["e.jsonl", "no requests"]),
    "trace-with-requests": (lambda t: (*sim_trace(trace(t, "ok.jsonl")), "--requests", "3"),
                            ["--requests 3", "trace"]),
    "config-is-a-list": (lambda t: ("simulate", "--config", str(_write(t / "l.yaml", "- 1\n- 2\n"))),
                         ["l.yaml", "expected a mapping", "list"]),
    "config-missing": (lambda t: ("simulate", "--config", str(t / "nope.yaml")), ["nope.yaml", "not found"]),
    "set-bad-yaml": (lambda t: (*SIM, "--set", "chunk_size=[1"), ["--set 'chunk_size=[1'", "YAML"]),
    "set-unknown-field": (lambda t: (*SIM, "--set", "chunksize=64"), ["chunksize"]),
    "run-zero-requests": (lambda t: ("run", "--config", "tiny", "--requests", "0"), ["--requests", ">= 1, got 0"]),
    "run-negative-requests": (lambda t: ("run", "--config", "tiny", "--requests", "-1"), ["--requests", "got -1"]),
    "run-zero-prompt": (lambda t: ("run", "--config", "tiny", "--min-prompt", "0", "--max-prompt", "0"),
                        ["--min-prompt", ">= 1, got 0"]),
    "run-min-above-max": (lambda t: ("run", "--config", "tiny", "--min-prompt", "200", "--max-prompt", "10"),
                          ["--max-prompt", "10 is below --min-prompt 200"]),
    "run-prompt-over-context": (lambda t: ("run", "--config", "tiny", "--max-prompt", "250"),
                                ["--max-prompt", "250 + --max-tokens 24 exceeds the 256-token context"]),
    "run-max-tokens-over-context": (lambda t: ("run", "--config", "tiny", "--max-tokens", "300"),
                                    ["--max-tokens", "no room for a prompt"]),
    "run-bad-temperature": (lambda t: ("run", "--config", "tiny", "--temperature", "-1"), ["temperature"]),
    "run-device-cuda-without-gpu": (lambda t: ("run", "--config", "tiny", "--set", "device=cuda"),
                                    ["runtime.device", "CUDA is not available"]),
    "report-no-report": (lambda t: ("report", str(t)), ["no report.json"]),
    "report-not-json": (lambda t: ("report", str(_write(t / "report.json", '{"summary": ').parent)),
                        ["report.json", "not valid JSON"]),
    "report-partial": (lambda t: ("report", str(_write(t / "report.json", '{"summary": {}}').parent)),
                       ["report.json", "not a complete report", "config, requests"]),
    "compare-unknown-planner": (lambda t: ("compare", "--config", "tiny", "--planners", "sarathi,foo",
                                           "--simulate", "--quiet", "--out", str(t / "cmp")),
                                ["unknown planner 'foo'"]),
    "memory-negative-device": (lambda t: ("memory", "--device-memory-gb", "-1"),
                               ["--device-memory-gb", "> 0"]),
    # number flags, checked as argparse parses them (cli/common.py `number`)
    "run-negative-qps": (lambda t: ("run", "--config", "tiny", "--qps", "-1"),
                         ["--qps: must be >= 0, got -1"]),
    "run-qps-not-a-number": (lambda t: ("run", "--qps", "fast"), ["--qps: expected a number, got 'fast'"]),
    "run-nan-qps": (lambda t: ("run", "--qps", "nan"), ["--qps: expected a finite number"]),
    "simulate-negative-seed": (lambda t: (*SIM, "--seed", "-1"), ["--seed: must be >= 0, got -1"]),
    "bench-zero-qps": (lambda t: ("bench", "serve", "--qps", "0"), ["--qps: must be > 0, got 0"]),
    "bench-zero-probes": (lambda t: ("bench", "serve", "--capacity", "--max-probes", "0"),
                          ["--max-probes: must be >= 1, got 0"]),
    "bench-half-request": (lambda t: ("bench", "serve", "--requests", "2.5"),
                           ["--requests: expected a whole number, got '2.5'"]),
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_bad_input_exits_2_naming_it(case, tmp_path, capsys, monkeypatch):
    if case == "run-device-cuda-without-gpu":
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    monkeypatch.chdir(tmp_path)  # whatever a run would write lands here
    argv, needles = CLI_CASES[case]
    line = cli_error(capsys, *argv(tmp_path))
    for needle in needles:
        assert needle in line, line
    # nothing ran: no run directory (compare's first planner included)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cmp").exists()


def test_a_good_command_after_bad_ones_works(tmp_path, capsys):
    assert main([*sim_trace(trace(tmp_path, "ok.jsonl")), "--out", str(tmp_path / "o")]) == 0
    assert read_report(tmp_path / "o")["summary"]["finish_reasons"] == {"length": 1}


def test_traceback_only_with_debug(tmp_path):
    """The installed CLI, as a user runs it: one line and exit 2 (a flag's own range, as
    argparse parses it, too); --debug adds the traceback of an error found later."""
    cli = [sys.executable, "-m", "pp_runtime.cli"]
    r = subprocess.run([*cli, "run", "--config", "tiny", "--requests", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --requests: must be >= 1, got 0"
    args = ["run", "--config", "tiny", "--max-prompt", "250"]
    r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --max-prompt: 250") \
        and "Traceback" not in r.stderr
    r = subprocess.run([*cli, "--debug", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def test_report_json_is_strict_json(tmp_path, capsys):
    """One request generating one token has no time between tokens: those percentiles were
    NaN, written as `NaN` (not JSON). Now null, and any strict parser reads the file."""
    path = tmp_path / "one.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_len": 10, "output_len": 1}\n')
    assert main([*sim_trace(str(path)), "--out", str(tmp_path / "o")]) == 0

    def reject(name):
        raise ValueError(f"{name} in report.json")
    report = json.loads((tmp_path / "o" / "report.json").read_text(), parse_constant=reject)
    assert report["summary"]["tbt_s"]["median"] is None
    assert strict_json({"a": [math.nan, 1.0, math.inf], "b": (-math.inf,)}) == {"a": [None, 1.0, None],
                                                                               "b": [None]}


# ---- the Python API --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_positions=64)


@pytest.mark.parametrize("call, needles", [
    (lambda g: g([[1, 2, 3], [4, 5]], arrival_s=[0.0, float("nan")]), ["request 1: arrival_s", "nan"]),
    (lambda g: g([[1, 2, 3], [4, 5]], arrival_s=[0.0, float("inf")]), ["request 1: arrival_s", "inf"]),
    (lambda g: g([[1, 2, 3], [4, 5]], arrival_s=[1.0, 0.5]), ["request 1: arrival_s 0.5 is before"]),
    (lambda g: g([[1, 2, 3], [4, 5]], arrival_s=[0.0]), ["2 prompts but 1 arrival_s"]),
    (lambda g: g([[1, 2]], SamplingParams(temperature="0.5")), ["request 0: temperature", "'0.5'"]),
    (lambda g: g([[1, 2]], SamplingParams(temperature=math.inf)), ["temperature must be a finite"]),
    (lambda g: g([[1, 2]], SamplingParams(top_p=math.nan)), ["top_p"]),
    (lambda g: g([[1, 2]], SamplingParams(seed="abc")), ["seed must be an int", "'abc'"]),
    (lambda g: g([[1, 2]], SamplingParams(ignore_eos="no")), ["ignore_eos must be True or False"]),
    (lambda g: g([[1, 2]], SamplingParams(max_tokens=True)), ["max_tokens must be an int"]),
    (lambda g: g([[1, 2]], [None]), ["request 0: params must be a SamplingParams, got None"]),
    (lambda g: g([[1, 2]], "greedy"), ["params must be a SamplingParams or a list"]),
    (lambda g: g(5), ["prompt_token_ids must be a list of prompts", "int"]),
    (lambda g: g("hello"), ["prompt_token_ids must be a list of prompts", "str"]),
    (lambda g: g([[1, 2.5]]), ["request 0: prompt must be a list of int token ids"]),
], ids=["nan-arrival", "inf-arrival", "decreasing-arrival", "arrival-count", "str-temperature",
        "inf-temperature", "nan-top-p", "str-seed", "str-ignore-eos", "bool-max-tokens",
        "none-params", "str-params", "int-prompts", "str-prompts", "float-token"])
def test_api_bad_input_runs_nothing(llm, call, needles):
    with pytest.raises(InvalidRequestError) as err:
        call(llm.generate)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    # nothing ran and the engine is usable: both requests finish
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), arrival_s=[0.0, 0.01])
    assert [o.finish_reason.value for o in outs] == ["length", "length"]


numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                    st.booleans(), st.text(max_size=3), st.none())


@settings(max_examples=300, deadline=None)
@given(temperature=numbers, top_p=numbers, seed=numbers, max_tokens=numbers, arrival=numbers)
def test_any_value_is_accepted_as_valid_or_rejected_by_name(temperature, top_p, seed,
                                                            max_tokens, arrival):
    """Whatever the values, the check either accepts them (and then they are valid numbers
    of the right type) or raises InvalidRequestError naming the field: never another
    exception, never a silent conversion."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    try:
        _, plist, arrivals = check_requests([[1, 2]], sp, [arrival], 512, 10**6)
    except InvalidRequestError as exc:
        named = [f for f, ok in (("temperature", _finite(temperature) and temperature >= 0),
                                 ("top_p", _finite(top_p) and 0 < top_p <= 1),
                                 ("seed", seed is None or _int(seed)),
                                 ("max_tokens", _int(max_tokens) and max_tokens >= 1),
                                 ("arrival_s", _finite(arrival) and arrival >= 0)) if not ok]
        assert named and all(f in str(exc) for f in named), (named, str(exc))
        return
    assert _finite(plist[0].temperature) and 0 < plist[0].top_p <= 1 and _int(plist[0].max_tokens)
    assert math.isfinite(arrivals[0]) and arrivals[0] >= 0


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ---- checkpoints -----------------------------------------------------------------------------
def _nan_weights(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    name = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))
    tensors[name][0, :3] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})


def _drop_key(d: Path, key: str) -> None:
    cfg = json.loads((d / "config.json").read_text())
    del cfg[key]
    (d / "config.json").write_text(json.dumps(cfg))


def _cut(d: Path) -> None:
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


CHECKPOINT_CASES = {  # how to break a good checkpoint -> what the message must name
    "empty-safetensors": (lambda d: next(d.glob("*.safetensors")).write_bytes(b""),
                          ["model.safetensors", "not a readable safetensors file", "empty"]),
    "truncated-safetensors": (_cut, ["model.safetensors", "truncated"]),
    "corrupt-safetensors": (lambda d: next(d.glob("*.safetensors")).write_bytes(b"\x00junk" * 99),
                            ["model.safetensors", "corrupt"]),
    "config-not-json": (lambda d: (d / "config.json").write_text("{not json"),
                        ["config.json", "not valid JSON"]),
    "config-without-n_head": (lambda d: _drop_key(d, "n_head"), ["config.json", "no n_head"]),
    "config-a-list": (lambda d: (d / "config.json").write_text("[1]"), ["config.json", "JSON object"]),
    "nan-weights": (_nan_weights, ["layers.1.fc1.weight", "NaN or infinite"]),
    "missing-tensor": (lambda d: _drop_tensor(d, "h.2.ln_1.bias"), ["h.2.ln_1.bias is missing"]),
}


def _drop_tensor(d: Path, suffix: str) -> None:
    from safetensors.torch import load_file, save_file
    f = next(d.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(f).items() if not k.endswith(suffix)}
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    from conftest import hf_model
    path = tmp_path_factory.mktemp("good-gpt")
    hf_model("gpt").save_pretrained(path)  # one model.safetensors
    return path


def _broken(good: Path, tmp_path: Path, case: str) -> Path:
    import shutil
    d = tmp_path / case
    shutil.copytree(good, d)
    CHECKPOINT_CASES[case][0](d)
    return d


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_bad_checkpoint_is_named_at_load(case, gpt_checkpoint, tmp_path, capsys):
    d = _broken(gpt_checkpoint, tmp_path, case)
    line = cli_error(capsys, "run", "--checkpoint", str(d), "--requests", "1", "--max-tokens", "2",
                     "--quiet", "--out", str(tmp_path / "out"))
    for needle in CHECKPOINT_CASES[case][1]:
        assert needle in line, line
    assert not (tmp_path / "out").exists()
    # the good checkpoint still runs
    assert main(["run", "--checkpoint", str(gpt_checkpoint), "--requests", "1", "--max-tokens",
                 "2", "--quiet", "--out", str(tmp_path / "good")]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["truncated-safetensors", "nan-weights"])
def test_bad_checkpoint_on_ray_is_a_user_error_too(case, gpt_checkpoint, tmp_path):
    """On the Ray path the file check runs on the driver before any actor starts; NaN weights
    are found by the stage actor that loads them, and still exit 2, naming the stage."""
    d = _broken(gpt_checkpoint, tmp_path, case)
    r = subprocess.run([sys.executable, "-m", "pp_runtime.cli", "run", "--checkpoint", str(d),
                        "--set", "executor=ray", "--set", "pp=2", "--requests", "1",
                        "--max-tokens", "2", "--quiet", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and CHECKPOINT_CASES[case][1][0] in last, last
    if case == "nan-weights":
        assert "stage 0 tp rank 0" in last
